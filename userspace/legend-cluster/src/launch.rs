//! Where a host learns its place in a job: `--hosts H --host-rank R --rendezvous HOST:PORT` on
//! the command line, or the environment torchrun or Slurm give each process they start.

use std::fmt;

use crate::ClusterError;

/// The environment variable that turns the reading of torchrun's and Slurm's variables off
/// (`LEGEND_LAUNCH=none`: one host, whatever they say).
pub const LAUNCH_VAR: &str = "LEGEND_LAUNCH";
/// The environment variable that overrides the rendezvous port torchrun's or Slurm's
/// variables give.
pub const PORT_VAR: &str = "LEGEND_RENDEZVOUS_PORT";
/// The rendezvous port under Slurm without [`PORT_VAR`]: this plus the job id modulo 1000,
/// so that jobs sharing a first node rarely collide.
pub const SLURM_BASE_PORT: u16 = 29_400;

/// Who said how the job is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// `--hosts`, `--host-rank` and `--rendezvous`.
    CommandLine,
    /// torchrun's `WORLD_SIZE`, `RANK`, `MASTER_ADDR` and `MASTER_PORT`.
    Torchrun,
    /// Slurm's `SLURM_NTASKS`, `SLURM_PROCID` and node list.
    Slurm,
}

impl fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchSource::CommandLine => "the command line",
            LaunchSource::Torchrun => "torchrun's environment",
            LaunchSource::Slurm => "Slurm's environment",
        })
    }
}

/// This process's place in a job of several hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Hosts H in the job (one process each).
    pub hosts: u32,
    /// This host's rank, `0..H`; rank 0 runs the rendezvous and writes the run.
    pub rank: u32,
    /// The rendezvous, `HOST:PORT`: rank 0 listens there (on that address only), the others
    /// connect to it.
    pub rendezvous: String,
    /// Where the layout came from.
    pub source: LaunchSource,
}

fn launch_error(message: String) -> ClusterError {
    ClusterError::Launch(message)
}

impl Launch {
    /// The job's layout from the command line's `hosts`, `rank` and `rendezvous` when any is
    /// given (all three are then needed, unless `hosts` is 1), else from `env` (torchrun's or
    /// Slurm's variables, see [`Launch::from_env`]); `None` for a job of one host.
    pub fn resolve(
        hosts: Option<u32>,
        rank: Option<u32>,
        rendezvous: Option<&str>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Launch>, ClusterError> {
        if hosts.is_none() && rank.is_none() && rendezvous.is_none() {
            return Launch::from_env(env);
        }
        let Some(hosts) = hosts else {
            return Err(launch_error(
                "--host-rank and --rendezvous need --hosts H (the job's number of hosts)".into(),
            ));
        };
        if hosts == 0 {
            return Err(launch_error("--hosts must be at least 1".into()));
        }
        if hosts == 1 && rank.unwrap_or(0) == 0 {
            return Ok(None);
        }
        let (Some(rank), Some(rendezvous)) = (rank, rendezvous) else {
            return Err(launch_error(format!(
                "--hosts {hosts} needs --host-rank R (0 .. {}) and --rendezvous HOST:PORT (where host 0 listens)",
                hosts - 1
            )));
        };
        Launch::checked(
            hosts,
            rank,
            rendezvous.to_string(),
            LaunchSource::CommandLine,
        )
    }

    /// The layout torchrun or Slurm gave this process through `env`: torchrun when its
    /// variables are set (`TORCHELASTIC_RUN_ID`, or `LOCAL_WORLD_SIZE` with `MASTER_ADDR`),
    /// else Slurm when `SLURM_PROCID` is set and `SLURM_NTASKS` > 1; `None` for one host, and
    /// always with `LEGEND_LAUNCH=none`.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, ClusterError> {
        if env(LAUNCH_VAR).is_some_and(|v| v == "none") {
            return Ok(None);
        }
        let torchrun = env("TORCHELASTIC_RUN_ID").is_some()
            || (env("LOCAL_WORLD_SIZE").is_some() && env("MASTER_ADDR").is_some());
        if torchrun {
            return Launch::torchrun(env);
        }
        if env("SLURM_PROCID").is_some() && env("SLURM_NTASKS").is_some() {
            return Launch::slurm(env);
        }
        Ok(None)
    }

    fn torchrun(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, ClusterError> {
        let local = number(env, "LOCAL_WORLD_SIZE", "torchrun")?.unwrap_or(1);
        if local > 1 {
            return Err(launch_error(format!(
                "torchrun started {local} processes on this host (LOCAL_WORLD_SIZE = {local}); Legend runs one process a host that drives all its GPUs: launch `torchrun --nproc-per-node=1 ... legendctl train ... --gpus {local}`"
            )));
        }
        let Some(hosts) = number(env, "WORLD_SIZE", "torchrun")? else {
            return Err(launch_error(
                "torchrun's environment has no WORLD_SIZE".into(),
            ));
        };
        let Some(rank) = number(env, "RANK", "torchrun")? else {
            return Err(launch_error("torchrun's environment has no RANK".into()));
        };
        // With one process a host, a node's rank is its process's rank.
        for var in ["GROUP_RANK", "NODE_RANK"] {
            if let Some(node) = number(env, var, "torchrun")?
                && node != rank
            {
                return Err(launch_error(format!(
                    "torchrun: {var} = {node} but RANK = {rank}; with one process a host they are the same (--nproc-per-node=1)"
                )));
            }
        }
        if hosts <= 1 {
            return Ok(None);
        }
        let Some(addr) = env("MASTER_ADDR") else {
            return Err(launch_error(
                "torchrun's environment has no MASTER_ADDR".into(),
            ));
        };
        let port = match port_override(env)? {
            Some(port) => port,
            None => {
                let Some(port) = number(env, "MASTER_PORT", "torchrun")? else {
                    return Err(launch_error(
                        "torchrun's environment has no MASTER_PORT".into(),
                    ));
                };
                let port = u16::try_from(port).map_err(|_| {
                    launch_error(format!("torchrun: MASTER_PORT = {port} is not a port"))
                })?;
                // torchrun's agent keeps its own store on MASTER_PORT then: the next port.
                if env("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True") {
                    port.checked_add(1).ok_or_else(|| {
                        launch_error("torchrun: MASTER_PORT 65535 leaves no port after it".into())
                    })?
                } else {
                    port
                }
            }
        };
        Launch::checked(
            hosts,
            rank,
            join_host_port(&addr, port),
            LaunchSource::Torchrun,
        )
    }

    fn slurm(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, ClusterError> {
        let hosts = number(env, "SLURM_NTASKS", "Slurm")?.unwrap_or(1);
        let rank = number(env, "SLURM_PROCID", "Slurm")?.unwrap_or(0);
        if hosts <= 1 {
            return Ok(None);
        }
        if let Some(nodes) = number(env, "SLURM_NNODES", "Slurm")?
            && nodes != hosts
        {
            return Err(launch_error(format!(
                "Slurm started {hosts} tasks on {nodes} nodes (SLURM_NTASKS, SLURM_NNODES); Legend runs one task a node that drives all its GPUs: srun --ntasks-per-node=1"
            )));
        }
        let (var, list) = [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]
        .iter()
        .find_map(|v| env(v).map(|l| (*v, l)))
        .ok_or_else(|| launch_error("Slurm's environment has no SLURM_NODELIST".into()))?;
        let nodes = expand_nodelist(&list)
            .map_err(|e| launch_error(format!("Slurm: {var} = {list:?}: {e}")))?;
        if nodes.len() as u32 != hosts {
            return Err(launch_error(format!(
                "Slurm: {var} names {} nodes but SLURM_NTASKS = {hosts}: run one task a node (srun --ntasks-per-node=1)",
                nodes.len()
            )));
        }
        let port = match port_override(env)? {
            Some(port) => port,
            None => {
                let job = number(env, "SLURM_JOB_ID", "Slurm")?.unwrap_or(0);
                SLURM_BASE_PORT + (job % 1000) as u16
            }
        };
        Launch::checked(
            hosts,
            rank,
            join_host_port(&nodes[0], port),
            LaunchSource::Slurm,
        )
    }

    fn checked(
        hosts: u32,
        rank: u32,
        rendezvous: String,
        source: LaunchSource,
    ) -> Result<Option<Launch>, ClusterError> {
        if rank >= hosts {
            return Err(launch_error(format!(
                "{source}: host rank {rank} is not below the {hosts} hosts"
            )));
        }
        split_host_port(&rendezvous)
            .map_err(|e| launch_error(format!("{source}: rendezvous {rendezvous:?}: {e}")))?;
        Ok(Some(Launch {
            hosts,
            rank,
            rendezvous,
            source,
        }))
    }
}

/// `LEGEND_RENDEZVOUS_PORT`, when set.
fn port_override(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<u16>, ClusterError> {
    env(PORT_VAR)
        .map(|v| {
            v.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| launch_error(format!("{PORT_VAR} = {v:?} is not a port (1-65535)")))
        })
        .transpose()
}

/// A non-negative integer variable of `who`'s, when set.
fn number(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    who: &str,
) -> Result<Option<u32>, ClusterError> {
    env(var)
        .map(|v| {
            v.trim().parse::<u32>().map_err(|_| {
                launch_error(format!(
                    "{who}: {var} = {v:?} is not a non-negative integer"
                ))
            })
        })
        .transpose()
}

/// `host:port`, bracketing an IPv6 address.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The host and port of `HOST:PORT` (`[V6]:PORT` for IPv6 addresses).
pub fn split_host_port(s: &str) -> Result<(&str, u16), String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| "expected HOST:PORT".to_string())?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err("no host before the port".into());
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| format!("{port:?} is not a port (1-65535)"))?;
    Ok((host, port))
}

/// The host names of a Slurm node list: `node[01-04,07],gpu12` is node01, node02, node03,
/// node04, node07 and gpu12, in order; ranges keep the zero padding of their start; a name
/// may hold several bracketed parts (`r[1-2]n[1-2]`: r1n1, r1n2, r2n1, r2n2).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err("an empty name".into());
        }
        names.extend(expand_name(item)?);
    }
    if names.is_empty() {
        return Err("no nodes".into());
    }
    Ok(names)
}

/// `list` cut at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0u32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested brackets".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("a ']' without its '['".into()),
            ',' if depth == 0 => {
                items.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' without its ']'".into());
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// The names one node-list item stands for (its bracketed parts expanded left to right).
fn expand_name(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_string()]);
    };
    let close = open + item[open..].find(']').ok_or("a '[' without its ']'")?;
    let (prefix, body, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_name(rest)?;
    let mut names = Vec::new();
    for part in body.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let parse = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{part:?} in [{body}] is not a number or a range"));
            }
            s.parse::<u64>()
                .map_err(|_| format!("{s:?} in [{body}] is too large"))
        };
        let (from, to) = (parse(lo)?, parse(hi)?);
        if from > to {
            return Err(format!("the range {part:?} in [{body}] runs backwards"));
        }
        if to - from >= 100_000 {
            return Err(format!(
                "the range {part:?} in [{body}] names too many nodes"
            ));
        }
        let width = lo.len();
        for n in from..=to {
            for tail in &tails {
                names.push(format!("{prefix}{n:0width$}{tail}"));
            }
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn slurm_node_lists_expand_ranges_lists_and_padding() {
        let e = |s| expand_nodelist(s).unwrap();
        assert_eq!(e("node[01-04]"), ["node01", "node02", "node03", "node04"]);
        assert_eq!(e("gpu7"), ["gpu7"]);
        assert_eq!(
            e("a[1,3-4],b[08-10],c"),
            ["a1", "a3", "a4", "b08", "b09", "b10", "c"]
        );
        assert_eq!(e("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(e("x[9-11]-ib"), ["x9-ib", "x10-ib", "x11-ib"]);
        assert_eq!(e("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        for bad in [
            "node[01-04",
            "node01]",
            "node[a-b]",
            "node[4-1]",
            "node[1-2],,x",
            "n[[1]]",
            "",
            "n[1-999999]",
        ] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_command_line_needs_all_three_or_one_host() {
        let none = env(&[]);
        let l = Launch::resolve(Some(2), Some(1), Some("10.0.0.1:29500"), &none)
            .unwrap()
            .unwrap();
        assert_eq!(
            (l.hosts, l.rank, l.source),
            (2, 1, LaunchSource::CommandLine)
        );
        assert_eq!(Launch::resolve(Some(1), None, None, &none).unwrap(), None);
        assert_eq!(Launch::resolve(None, None, None, &none).unwrap(), None);
        let e = Launch::resolve(Some(2), Some(0), None, &none).unwrap_err();
        assert!(e.to_string().contains("--rendezvous HOST:PORT"), "{e}");
        let e = Launch::resolve(Some(2), Some(2), Some("h:1"), &none).unwrap_err();
        assert!(
            e.to_string().contains("rank 2 is not below the 2 hosts"),
            "{e}"
        );
        let e = Launch::resolve(Some(2), Some(1), Some("h"), &none).unwrap_err();
        assert!(e.to_string().contains("HOST:PORT"), "{e}");
        let e = Launch::resolve(None, Some(1), None, &none).unwrap_err();
        assert!(e.to_string().contains("--hosts"), "{e}");
        assert_eq!(split_host_port("[::1]:80").unwrap(), ("::1", 80));
        assert!(split_host_port("h:0").is_err());
    }

    #[test]
    fn torchrun_gives_one_process_a_host_or_is_told_what_to_run() {
        let vars = [
            ("TORCHELASTIC_RUN_ID", "job"),
            ("WORLD_SIZE", "4"),
            ("RANK", "2"),
            ("GROUP_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "node01"),
            ("MASTER_PORT", "29500"),
        ];
        let l = Launch::from_env(&env(&vars)).unwrap().unwrap();
        assert_eq!(
            l,
            Launch {
                hosts: 4,
                rank: 2,
                rendezvous: "node01:29500".into(),
                source: LaunchSource::Torchrun
            }
        );
        // The agent holds MASTER_PORT: the next one.
        let mut with_store = vars.to_vec();
        with_store.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        let l = Launch::from_env(&env(&with_store)).unwrap().unwrap();
        assert_eq!(l.rendezvous, "node01:29501");
        let mut port = vars.to_vec();
        port.push((PORT_VAR, "31000"));
        assert_eq!(
            Launch::from_env(&env(&port)).unwrap().unwrap().rendezvous,
            "node01:31000"
        );
        let mut per_gpu = vars.to_vec();
        per_gpu[4] = ("LOCAL_WORLD_SIZE", "8");
        let e = Launch::from_env(&env(&per_gpu)).unwrap_err().to_string();
        assert!(
            e.contains("--nproc-per-node=1") && e.contains("--gpus 8"),
            "{e}"
        );
        let mut off = vars.to_vec();
        off[3] = ("GROUP_RANK", "1");
        assert!(Launch::from_env(&env(&off)).is_err());
        let mut bad = vars.to_vec();
        bad[6] = ("MASTER_PORT", "http");
        let e = Launch::from_env(&env(&bad)).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
        let mut ignored = vars.to_vec();
        ignored.push((LAUNCH_VAR, "none"));
        assert_eq!(Launch::from_env(&env(&ignored)).unwrap(), None);
    }

    #[test]
    fn slurm_gives_the_first_node_and_a_port_of_the_job() {
        let vars = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NNODES", "4"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_JOB_NODELIST", "gpu[07-10]"),
        ];
        let l = Launch::from_env(&env(&vars)).unwrap().unwrap();
        assert_eq!(
            l,
            Launch {
                hosts: 4,
                rank: 3,
                rendezvous: "gpu07:29856".into(),
                source: LaunchSource::Slurm
            }
        );
        let mut two_a_node = vars.to_vec();
        two_a_node[2] = ("SLURM_NNODES", "2");
        let e = Launch::from_env(&env(&two_a_node)).unwrap_err().to_string();
        assert!(e.contains("--ntasks-per-node=1"), "{e}");
        let mut short = vars.to_vec();
        short[4] = ("SLURM_JOB_NODELIST", "gpu[07-09]");
        assert!(Launch::from_env(&env(&short)).is_err());
        // One task: one host.
        assert_eq!(
            Launch::from_env(&env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])).unwrap(),
            None
        );
    }
}
