//! The rendezvous: rank 0 serves a small store on `MASTER_ADDR:MASTER_PORT`; every other rank
//! registers there with its data port, its version and a hash of its training flags, and gets
//! back the address of every rank (torchrun's c10d store, reduced to what a ring needs).
//!
//! Everything has a deadline: a rank that never arrives makes rank 0 fail with the list of the
//! missing ranks, and a rank that cannot reach rank 0 fails saying where it looked. A group
//! whose ranks run different versions or different flags is refused, naming the ranks, before
//! any of them computes a step: a mismatch there would otherwise show up as a hang or as
//! silently diverging weights.

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// What a rank tells the store about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub rank: usize,
    pub world: usize,
    /// The program's version: ranks of one job must run the same build.
    pub version: String,
    /// A hash of the flags that must agree across ranks (see `config_hash`).
    pub config: String,
    /// The port this rank's ring listener accepts on.
    pub port: u16,
}

/// Where every rank's ring listener is, indexed by rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peers {
    pub addrs: Vec<SocketAddr>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    Peers(Peers),
    Error(String),
}

/// A stable hash (FNV-1a, 64 bits) of the flags every rank must share, as hex.
pub fn config_hash(flags: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in flags.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn write_line<T: Serialize>(stream: &mut TcpStream, value: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)?;
    stream.flush()
}

/// Reads one JSON line of at most 1 MiB: a peer cannot make the store allocate without bound.
fn read_line<T: for<'de> Deserialize<'de>>(stream: &TcpStream) -> Result<T> {
    let mut line = Vec::new();
    let n = BufReader::new(Read::take(stream, 1 << 20)).read_until(b'\n', &mut line)?;
    if n == 0 {
        bail!("the connection closed before a message arrived");
    }
    serde_json::from_slice(&line).context("a malformed rendezvous message (is something else listening on this port?)")
}

/// Binds the store's listener on rank 0. A port already in use is one line saying which.
pub fn bind_store(port: u16) -> Result<TcpListener> {
    TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        anyhow!(
            "rank 0 cannot serve the rendezvous store on port {port}: {e}; another job may be using it: \
             choose a free MASTER_PORT (the launcher's --master-port), or set RLHF_STORE_PORT"
        )
    })
}

/// Rank 0's side: waits up to `timeout` for every other rank to register, checks the group
/// agrees, and answers each with the table of addresses. `me` is rank 0's own registration;
/// `my_host` the address the others reach rank 0's ring listener at.
pub fn serve(listener: &TcpListener, me: &Registration, my_host: &str, timeout: Duration) -> Result<Peers> {
    let deadline = Instant::now() + timeout;
    listener.set_nonblocking(true)?;
    let world = me.world;
    let mut joined: Vec<Option<(TcpStream, Registration, SocketAddr)>> = (0..world).map(|_| None).collect();
    let mut arrived = 1;
    let mut problem: Option<String> = None;
    while arrived < world && problem.is_none() {
        match listener.accept() {
            Ok((stream, peer)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(remaining(deadline)))?;
                stream.set_write_timeout(Some(remaining(deadline)))?;
                let reg: Registration = match read_line(&stream) {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("warning: ignored a connection to the rendezvous store from {peer}: {e}");
                        continue;
                    }
                };
                problem = disagreement(me, &reg);
                let r = reg.rank;
                if r < world && joined[r].is_none() {
                    arrived += 1;
                    let addr = SocketAddr::new(peer.ip(), reg.port);
                    joined[r] = Some((stream, reg, addr));
                } else if problem.is_none() {
                    problem = Some(format!("two processes registered as rank {r}: give every process its own RANK"));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> =
                        (1..world).filter(|&r| joined[r].is_none()).map(|r| r.to_string()).collect();
                    problem = Some(format!(
                        "rendezvous timed out after {}s: rank(s) {} of {world} never arrived at the store on port {} \
                         (were they started, with the same MASTER_ADDR and MASTER_PORT? raise --dist-timeout if they start slowly)",
                        timeout.as_secs(),
                        missing.join(", "),
                        listener.local_addr()?.port()
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e).context("the rendezvous store stopped accepting connections"),
        }
    }
    let my_addr = format!("{my_host}:{}", me.port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| anyhow!("cannot resolve this host's address {my_host:?} for the other ranks"))?;
    let reply = match &problem {
        Some(p) => Reply::Error(p.clone()),
        None => Reply::Peers(Peers {
            addrs: (0..world).map(|r| if r == 0 { my_addr } else { joined[r].as_ref().unwrap().2 }).collect(),
        }),
    };
    for (stream, _, _) in joined.iter_mut().flatten() {
        // A rank that went away meanwhile finds out from its own timeout.
        let _ = write_line(stream, &reply);
    }
    match reply {
        Reply::Peers(p) => Ok(p),
        Reply::Error(e) => Err(anyhow!(e)),
    }
}

/// Why `reg` cannot join rank 0's group, if it cannot.
fn disagreement(me: &Registration, reg: &Registration) -> Option<String> {
    let r = reg.rank;
    if reg.world != me.world {
        return Some(format!(
            "rank {r} was started with a world size of {}, rank 0 with {}: every rank needs the same WORLD_SIZE",
            reg.world, me.world
        ));
    }
    if r == 0 || r >= me.world {
        return Some(format!("a process registered as rank {r}, outside ranks 1..{}", me.world));
    }
    if reg.version != me.version {
        return Some(format!(
            "rank {r} runs version {}, rank 0 runs {}: install the same build on every host",
            reg.version, me.version
        ));
    }
    if reg.config != me.config {
        return Some(format!(
            "rank {r}'s training flags differ from rank 0's (config hash {} against {}): start every rank with the same flags",
            reg.config, me.config
        ));
    }
    None
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// A non-zero rank's side: registers with the store at `master`, retrying until it answers
/// (rank 0 may start later), and waits for the table until `timeout` has passed.
pub fn join(master: (&str, u16), me: &Registration, timeout: Duration) -> Result<Peers> {
    let deadline = Instant::now() + timeout;
    let where_ = format!("{}:{}", master.0, master.1);
    let mut last_error = String::from("no attempt");
    let mut stream = loop {
        let addrs: Vec<SocketAddr> = match where_.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last_error = format!("cannot resolve {where_}: {e}");
                Vec::new()
            }
        };
        let mut connected = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, remaining(deadline).min(Duration::from_secs(2))) {
                Ok(s) => {
                    connected = Some(s);
                    break;
                }
                Err(e) => last_error = e.to_string(),
            }
        }
        if let Some(s) = connected {
            break s;
        }
        if Instant::now() >= deadline {
            bail!(
                "rank {}: rendezvous timed out after {}s: could not reach rank 0's store at {where_} ({last_error}); \
                 is rank 0 running, and are MASTER_ADDR and MASTER_PORT right?",
                me.rank,
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    stream.set_read_timeout(Some(remaining(deadline)))?;
    stream.set_write_timeout(Some(remaining(deadline)))?;
    write_line(&mut stream, me)
        .with_context(|| format!("rank {}: cannot register with the store at {where_}", me.rank))?;
    let reply: Reply = read_line(&stream).map_err(|e| {
        anyhow!(
            "rank {}: rank 0's store at {where_} gave no table within {}s ({e}): another rank is missing, or rank 0 failed; see rank 0's log",
            me.rank,
            timeout.as_secs()
        )
    })?;
    match reply {
        Reply::Peers(p) if p.addrs.len() == me.world => Ok(p),
        Reply::Peers(p) => bail!("rank 0 answered with {} ranks, this rank expects {}", p.addrs.len(), me.world),
        Reply::Error(e) => Err(anyhow!(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(rank: usize, world: usize, config: &str) -> Registration {
        Registration { rank, world, version: "v1".into(), config: config_hash(config), port: 1000 + rank as u16 }
    }

    /// Rank 0 serving and ranks 1.. joining, each on its own thread; `regs[0]` is rank 0's.
    fn rendezvous(regs: Vec<Registration>, timeout: Duration) -> Vec<Result<Peers>> {
        let listener = bind_store(0).unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::scope(|s| {
            let hs: Vec<_> = regs
                .into_iter()
                .map(|me| {
                    let listener = &listener;
                    s.spawn(move || {
                        if me.rank == 0 && me.port == 1000 {
                            serve(listener, &me, "127.0.0.1", timeout)
                        } else {
                            join(("127.0.0.1", port), &me, timeout)
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The flags' hash is 64-bit FNV-1a, as its published test vectors give it.
    #[test]
    fn the_config_hash_is_fnv_1a() {
        assert_eq!(config_hash(""), "cbf29ce484222325");
        assert_eq!(config_hash("a"), "af63dc4c8601ec8c");
        assert_eq!(config_hash("foobar"), "85944171f73967e8");
    }

    #[test]
    fn every_rank_gets_the_address_table() -> Result<()> {
        for world in 2..=4 {
            let regs = (0..world).map(|r| reg(r, world, "a")).collect();
            for res in rendezvous(regs, Duration::from_secs(5)) {
                let ports: Vec<u16> = res?.addrs.iter().map(|a| a.port()).collect();
                assert_eq!(ports, (0..world as u16).map(|r| 1000 + r).collect::<Vec<_>>(), "world {world}");
            }
        }
        Ok(())
    }

    /// A rank registered twice, or one past the world, is refused by rank 0 naming it; the
    /// process it refused gets no table and times out.
    #[test]
    fn a_rank_twice_or_outside_the_world_is_refused() {
        for (regs, needle) in [
            (vec![reg(0, 3, "a"), reg(1, 3, "a"), reg(1, 3, "a")], "two processes registered as rank 1"),
            (vec![reg(0, 3, "a"), reg(3, 3, "a")], "registered as rank 3, outside ranks 1..3"),
            (vec![reg(0, 2, "a"), Registration { port: 1005, ..reg(0, 2, "a") }], "registered as rank 0, outside"),
        ] {
            let results = rendezvous(regs, Duration::from_secs(1));
            let err = results[0].as_ref().unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
            assert!(results.iter().all(Result::is_err), "every process of the group fails");
        }
    }

    #[test]
    fn a_group_that_disagrees_is_refused_naming_the_rank() {
        let mut other_version = reg(1, 2, "a");
        other_version.version = "v2".into();
        for (regs, needle) in [
            (vec![reg(0, 2, "a"), reg(1, 2, "b")], "rank 1's training flags differ from rank 0's"),
            (vec![reg(0, 2, "a"), other_version], "rank 1 runs version v2, rank 0 runs v1"),
            (vec![reg(0, 2, "a"), reg(1, 3, "a")], "rank 1 was started with a world size of 3"),
        ] {
            for res in rendezvous(regs, Duration::from_secs(5)) {
                let err = res.unwrap_err().to_string();
                assert!(err.contains(needle), "{err}");
            }
        }
    }

    /// A rank started before rank 0 keeps knocking until the store is served.
    #[test]
    fn a_rank_started_first_waits_for_the_store() -> Result<()> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let store = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            serve(&bind_store(port)?, &reg(0, 2, "a"), "127.0.0.1", Duration::from_secs(5))
        });
        let peers = join(("127.0.0.1", port), &reg(1, 2, "a"), Duration::from_secs(5))?;
        assert_eq!(peers, store.join().unwrap()?);
        Ok(())
    }

    /// A store that answers with a table of another size, or with no JSON, is refused in one
    /// line saying so.
    #[test]
    fn a_wrong_answer_from_the_store_is_refused() -> Result<()> {
        for (answer, needle) in [
            (&b"{\"peers\":{\"addrs\":[\"127.0.0.1:1\"]}}\n"[..], "rank 0 answered with 1 ranks, this rank expects 2"),
            (b"HTTP/1.1 400\n", "malformed rendezvous message"),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let port = listener.local_addr()?.port();
            let store = std::thread::spawn(move || -> Result<()> {
                let (mut stream, _) = listener.accept()?;
                let _: Registration = read_line(&stream)?;
                Ok(stream.write_all(answer)?)
            });
            let err = join(("127.0.0.1", port), &reg(1, 2, "a"), Duration::from_secs(5)).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
            store.join().unwrap()?;
        }
        Ok(())
    }

    #[test]
    fn missing_ranks_and_a_missing_store_time_out_with_names() {
        let t0 = Instant::now();
        let res = rendezvous(vec![reg(0, 4, "a"), reg(2, 4, "a")], Duration::from_millis(400));
        let err = res[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("rank(s) 1, 3 of 4 never arrived"), "{err}");
        let err = res[1].as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 0's store") || err.contains("never arrived"), "{err}");
        let free = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let err = join(("127.0.0.1", free), &reg(1, 2, "a"), Duration::from_millis(300)).unwrap_err().to_string();
        assert!(err.contains("could not reach rank 0's store"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let taken = bind_store(0).unwrap();
        let err = bind_store(taken.local_addr().unwrap().port()).unwrap_err().to_string();
        assert!(err.contains("choose a free MASTER_PORT"), "{err}");
    }
}
