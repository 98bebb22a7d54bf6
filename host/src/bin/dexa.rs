use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = dexa::cli::Cli::parse();
    cli.log_format.install();
    match dexa::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
