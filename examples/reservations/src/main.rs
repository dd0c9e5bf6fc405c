//! Serves the Reservations example: `DATABASE_URL` (required) and `LISTEN` (default
//! 127.0.0.1:50070).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let database_url = std::env::var("DATABASE_URL")
        .map_err(|_| anyhow::anyhow!("set DATABASE_URL to a Postgres database"))?;
    let addr = std::env::var("LISTEN")
        .unwrap_or_else(|_| "127.0.0.1:50070".to_owned())
        .parse()?;
    reservations::run(addr, &database_url).await
}
