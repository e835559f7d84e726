//! DeepSpeed hostfiles and their `--include` / `--exclude` filters, as DeepSpeed's
//! `deepspeed/launcher/runner.py` reads them (`fetch_hostfile`, `parse_inclusion_exclusion`):
//! one `host slots=N` per line, `#` comments (to the end of a line) and blank lines skipped,
//! hosts in file order; a filter is `NODE_SPEC[@NODE_SPEC...]` with
//! `NODE_SPEC = HOST[:SLOT[,SLOT...]]`.
//!
//! Stricter than DeepSpeed where it would guess: a line with anything after `slots=N`
//! (OpenMPI's `max_slots=`, which DeepSpeed ignores), `slots=0` and a host name starting with `-`
//! (ssh would take it for an option) are errors naming the file and line; a filter that leaves
//! nothing to run is an error too.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// DeepSpeed's default hostfile (`DLTS_HOSTFILE`).
pub const DEFAULT_HOSTFILE: &str = "/job/hostfile";

/// One host of the job and the slots (local device indices) its ranks use, in rank order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub host: String,
    pub slots: Vec<usize>,
}

/// Reads a hostfile: every host with slots `0..N`, in file order.
pub fn read(path: &Path) -> Result<Vec<Node>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("cannot read the hostfile {} (lines `host slots=N`): pass --hostfile FILE", path.display())
    })?;
    parse(&text, &path.display().to_string())
}

/// Parses hostfile text; `name` is the file's name for messages.
pub fn parse(text: &str, name: &str) -> Result<Vec<Node>> {
    let mut nodes: Vec<Node> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        // A comment may also end a line (DeepSpeed's pattern, anchored at the start, allows it).
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{name} line {}: {line:?}", i + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        let slots = match fields.as_slice() {
            [_, slots] => slots.strip_prefix("slots=").and_then(|n| n.parse::<usize>().ok()),
            _ => None,
        };
        let Some(slots) = slots else {
            bail!("{} is not `host slots=N` (e.g. `worker-0 slots=8`)", at());
        };
        let host = fields[0];
        if host.starts_with('-') {
            bail!("{}: a host name cannot start with '-'", at());
        }
        if slots == 0 {
            bail!("{}: a host needs at least 1 slot; remove the line to leave the host out", at());
        }
        if nodes.iter().any(|n| n.host == host) {
            bail!("{}: host {host} is listed twice; give each host one line", at());
        }
        nodes.push(Node { host: host.to_string(), slots: (0..slots).collect() });
    }
    if nodes.is_empty() {
        bail!("the hostfile {name} lists no hosts: add lines `host slots=N`");
    }
    Ok(nodes)
}

/// Applies DeepSpeed's `--include` or `--exclude` (at most one of them) to the hostfile's
/// hosts. The result keeps the hostfile's host order; an included host's slots are in the
/// order the spec gives them; hosts left with no slot are dropped.
pub fn filter(pool: &[Node], include: Option<&str>, exclude: Option<&str>) -> Result<Vec<Node>> {
    let (spec, including) = match (include, exclude) {
        (Some(_), Some(_)) => bail!("--include and --exclude cannot be used together (as in DeepSpeed): pick one"),
        (None, None) => return Ok(pool.to_vec()),
        (Some(s), None) => (s, true),
        (None, Some(s)) => (s, false),
    };
    let flag = if including { "--include" } else { "--exclude" };
    let mut chosen: Vec<Node> = if including { Vec::new() } else { pool.to_vec() };
    for node_spec in spec.split('@') {
        let (host, slots) = match node_spec.split_once(':') {
            Some((host, list)) => (host, Some(slot_list(list, node_spec, flag)?)),
            None => (node_spec, None),
        };
        let Some(known) = pool.iter().find(|n| n.host == host) else {
            let hosts: Vec<&str> = pool.iter().map(|n| n.host.as_str()).collect();
            bail!("{flag} {spec:?}: host {host:?} is not in the hostfile (its hosts: {})", hosts.join(", "));
        };
        if let Some(slot) = slots.iter().flatten().find(|s| !known.slots.contains(s)) {
            bail!("{flag} {spec:?}: host {host} has no slot {slot} (its slots: 0..{})", known.slots.len());
        }
        let slots = slots.unwrap_or_else(|| known.slots.clone());
        if including {
            // As DeepSpeed: a host named again replaces its earlier slots.
            chosen.retain(|n| n.host != host);
            chosen.push(Node { host: host.to_string(), slots });
        } else {
            let node = chosen.iter_mut().find(|n| n.host == host).expect("every host starts in the pool");
            node.slots.retain(|s| !slots.contains(s));
        }
    }
    let mut ordered = Vec::new();
    for host in pool {
        let Some(node) = chosen.iter().find(|n| n.host == host.host) else { continue };
        let mut slots: Vec<usize> = Vec::new();
        for &s in &node.slots {
            if !slots.contains(&s) {
                slots.push(s);
            }
        }
        if !slots.is_empty() {
            ordered.push(Node { host: node.host.clone(), slots });
        }
    }
    if ordered.is_empty() {
        bail!("{flag} {spec:?} leaves no slot on any host: nothing would run");
    }
    Ok(ordered)
}

/// `0,2` -> [0, 2].
fn slot_list(list: &str, node_spec: &str, flag: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| anyhow::anyhow!("{flag}: {node_spec:?} is not HOST or HOST:SLOT[,SLOT...] (e.g. worker-1:0,2)"))
}

/// DeepSpeed's `--num_gpus`: at most the first `n` slots of every host.
pub fn limit_slots(nodes: &mut [Node], n: usize) {
    for node in nodes {
        node.slots.truncate(n);
    }
}

/// Every rank of the job: the sum of the hosts' slots.
pub fn world_size(nodes: &[Node]) -> usize {
    nodes.iter().map(|n| n.slots.len()).sum()
}

/// `worker-0: 8, worker-1: 2` for messages.
pub fn describe(nodes: &[Node]) -> String {
    nodes.iter().map(|n| format!("{}: {}", n.host, n.slots.len())).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, slots: &[usize]) -> Node {
        Node { host: host.into(), slots: slots.to_vec() }
    }

    /// DeepSpeed's test pool: two hosts of 4 slots.
    fn pool() -> Vec<Node> {
        vec![node("worker-0", &[0, 1, 2, 3]), node("worker-1", &[0, 1, 2, 3])]
    }

    #[test]
    fn a_hostfile_lists_hosts_in_order_with_their_slots() -> Result<()> {
        let text = "# the cluster\nworker-1 slots=2\n\n  worker-2   slots=2  # spare\n# gone: worker-3 slots=8\nlocalhost slots=1\n123.23.12.10 slots=2\n";
        let nodes = parse(text, "hosts")?;
        assert_eq!(
            nodes,
            vec![
                node("worker-1", &[0, 1]),
                node("worker-2", &[0, 1]),
                node("localhost", &[0]),
                node("123.23.12.10", &[0, 1])
            ]
        );
        assert_eq!((world_size(&nodes), describe(&nodes[..2])), (7, "worker-1: 2, worker-2: 2".to_string()));
        Ok(())
    }

    #[test]
    fn a_bad_hostfile_is_one_error_naming_the_file_and_line() {
        for (text, want) in [
            ("worker-1 slots=2\nworker-2\n", "hosts line 2: \"worker-2\" is not `host slots=N`"),
            ("worker-1 slots=two\n", "line 1: \"worker-1 slots=two\" is not `host slots=N`"),
            ("worker-1 slots=2 max_slots=4\n", "line 1"),
            ("worker-1 slot=2\n", "is not `host slots=N`"),
            ("worker-1 slots=-1\n", "is not `host slots=N`"),
            ("a slots=1\n\nworker-1 slots=0\n", "line 3: \"worker-1 slots=0\": a host needs at least 1 slot"),
            ("worker-1 slots=2\nworker-1 slots=4\n", "line 2: \"worker-1 slots=4\": host worker-1 is listed twice"),
            ("-oProxyCommand=x slots=1\n", "cannot start with '-'"),
            ("# nothing\n\n", "lists no hosts"),
        ] {
            let err = parse(text, "hosts").unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(err.contains("hosts"), "names the file: {err}");
        }
    }

    #[test]
    fn include_and_exclude_select_hosts_and_slots_as_deepspeed() -> Result<()> {
        let one = vec![node("worker-0", &[0, 1, 2, 3])];
        let p = pool();
        for (pool, include, exclude, want) in [
            (&one, Some("worker-0:1"), None, vec![node("worker-0", &[1])]),
            (&one, None, Some("worker-0:1"), vec![node("worker-0", &[0, 2, 3])]),
            (&one, Some("worker-0:1,2"), None, vec![node("worker-0", &[1, 2])]),
            (&one, None, Some("worker-0:1,2"), vec![node("worker-0", &[0, 3])]),
            (&p, Some("worker-1:0,3"), None, vec![node("worker-1", &[0, 3])]),
            (&p, None, Some("worker-1:0,3"), vec![node("worker-0", &[0, 1, 2, 3]), node("worker-1", &[1, 2])]),
            // A whole host; the hostfile's order whatever the spec's; slots in the spec's order.
            (&p, Some("worker-1@worker-0:2,0"), None, vec![node("worker-0", &[2, 0]), node("worker-1", &[0, 1, 2, 3])]),
            (&p, None, Some("worker-0"), vec![node("worker-1", &[0, 1, 2, 3])]),
            // Repeats collapse; a host named again in --include takes its last slots.
            (&p, Some("worker-0:1,1"), None, vec![node("worker-0", &[1])]),
            (&p, Some("worker-0:1@worker-0:3"), None, vec![node("worker-0", &[3])]),
            (
                &p,
                None,
                Some("worker-0:1@worker-0:1,2"),
                vec![node("worker-0", &[0, 3]), node("worker-1", &[0, 1, 2, 3])],
            ),
            (&p, None, None, p.clone()),
        ] {
            assert_eq!(filter(pool, include, exclude)?, want, "include {include:?} exclude {exclude:?}");
        }
        Ok(())
    }

    #[test]
    fn a_bad_filter_is_one_error_naming_the_problem() {
        let p = pool();
        for (include, exclude, want) in [
            (Some("worker-0"), Some("worker-1"), "cannot be used together"),
            (
                Some("jeff"),
                None,
                "--include \"jeff\": host \"jeff\" is not in the hostfile (its hosts: worker-0, worker-1)",
            ),
            (None, Some("jeff"), "--exclude \"jeff\": host \"jeff\" is not in the hostfile"),
            (Some("worker-1:4"), None, "host worker-1 has no slot 4 (its slots: 0..4)"),
            (None, Some("worker-1:4"), "host worker-1 has no slot 4"),
            (Some("worker-1@worker-0:1@5"), None, "host \"5\" is not in the hostfile"),
            (Some("worker-1:a"), None, "\"worker-1:a\" is not HOST or HOST:SLOT[,SLOT...]"),
            (Some("worker-1:"), None, "is not HOST or HOST:SLOT"),
            (None, Some("worker-0@worker-1"), "leaves no slot on any host"),
        ] {
            let err = filter(&p, include, exclude).unwrap_err().to_string();
            assert!(err.contains(want), "include {include:?} exclude {exclude:?}: {err}");
        }
    }

    #[test]
    fn num_gpus_keeps_at_most_the_first_slots_of_each_host() {
        let mut nodes = vec![node("a", &[0, 1, 2, 3]), node("b", &[0])];
        limit_slots(&mut nodes, 2);
        assert_eq!(nodes, vec![node("a", &[0, 1]), node("b", &[0])]);
    }
}
