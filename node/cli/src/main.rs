//! The `moeswarm` command: parses the command line and hands it to one command's `run`
//! (`commands/<command>.rs`, each with its arguments and its run).

use std::process::ExitCode;

use clap::{ArgAction, Parser};

mod commands;
mod output;

#[derive(Parser)]
#[command(
    name = "moeswarm",
    version,
    about = "Run one large Mixture-of-Experts model across a swarm of small devices"
)]
struct Cli {
    /// More log lines on stderr (-v: debug, -vv: trace); RUST_LOG overrides.
    #[arg(short, long, global = true, action = ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: commands::Command,
}

/// Logs go to stderr through `tracing`: warnings and progress notes by default.
fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match cli.command.run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        // The reader went away (`moeswarm inspect big.gguf | head`): nothing more to say.
        Err(e) if output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
