//! Parity with the PyTorch reference (tests/fixtures, made by reference/generate.py), on the
//! backend named by `KEV_TEST_BACKEND` (`cpu` by default; `cuda` or `metal` in builds with that
//! feature). One test binary, so a GPU build ships a single executable to the GPU machine.

mod backbone;
mod common;
mod decision;
mod device_ops;
