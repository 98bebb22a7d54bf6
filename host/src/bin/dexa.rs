use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = dexa::cli::Cli::parse();
    let format = cli.log_format;
    format.install();
    match dexa::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            match format {
                dexa::cli::LogFormat::Json => tracing::error!("{err:#}"),
                dexa::cli::LogFormat::Text => eprintln!("error: {err:#}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}
