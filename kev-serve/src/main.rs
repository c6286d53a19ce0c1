//! The `kev-serve` binary: `cargo run --release -p kev-serve [-- --checkpoint DIR ...]`.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use kev_serve::{Config, Server};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    kev::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            EnvFilter::try_from_env("KEV_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let config = Config::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kev-http")
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let checkpoint = config.checkpoint_dir();
    let mut server = Server::start(config.clone()).await?;
    tracing::info!(addr = %server.addr(), checkpoint = %checkpoint.display(), "listening; loading the model");
    let load = tokio::select! {
        r = server.ready() => r.with_context(|| format!("serving `{}`", checkpoint.display()))?,
        () = shutdown_signal() => {
            server.shutdown().await?;
            return Ok(());
        }
    };
    let info = server.model_info();
    tracing::info!(
        addr = %server.addr(),
        backend = %info["backend"],
        dtype = %info["dtype"],
        load_s = format!("{:.2}", load.as_secs_f64()),
        workers = config.devices.len(),
        max_batch_tokens = config.max_batch_tokens,
        max_wait_ms = config.max_wait_ms,
        prefix_cache_mib = config.prefix_cache_mib,
        "kev-serve ready on http://{}", server.addr()
    );
    shutdown_signal().await;
    tracing::info!("shutting down: finishing accepted requests");
    server.shutdown().await?;
    tracing::info!("stopped");
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
