//! `kev-serve`: Kev decision models over HTTP.
//!
//! Requests from all connections go to one bounded queue in front of one model worker per
//! device ([`scheduler`]); a worker forms batches by a token budget and a short wait and runs
//! each as one call of [`kev::DecisionModel::run`]: records whose state's prefix is in the
//! device's [`kev::PrefixCache`] run their branches only, the others their state and branches
//! (in one pass over the layers where the states fit one piece), and the new prefixes are kept
//! for the next requests. [`server`] is the HTTP side
//! (axum): `POST /v1/score`, `GET /health`, `/ready`, `/metrics`, `/v1/model`.

pub mod config;
mod connections;
pub mod metrics;
pub mod scheduler;
pub mod server;
mod throttle;

pub use config::Config;
pub use server::{Server, StartError};
