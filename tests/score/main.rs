//! The `score` pipeline (`kev::score`): its output writer, streaming, resume and invalid-record
//! handling as a library, token-budget batches, and the `score` example's exit codes end to
//! end. One test binary.

mod batches;
mod cli;
mod common;
mod output;
mod stream;
