//! `legendctl plan`.

/// Arguments of `legendctl plan`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("the planner is not wired yet")
}
