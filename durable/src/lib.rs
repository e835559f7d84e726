//! Durable, atomic writes: the one implementation behind every directory and small file a run
//! saves (model directories, checkpoints, PEFT adapters, `latest`, evaluation reports, the
//! tokenizer, the data cache, wandb's offline run files).
//!
//! A directory is assembled in a hidden sibling `.tmp-<name>-<pid>`, every file and directory
//! in it is fsynced, and it then takes the final name in one step: on Linux `renameat2` with
//! `RENAME_EXCHANGE` swaps the complete new directory with the old one, so at every instant the
//! final name holds a complete directory, old or new. Where the exchange is unsupported (other
//! systems, some filesystems) the old directory is first renamed to `.old-<name>-<pid>` and the
//! new one moved in; a crash between those two renames leaves no directory at the final name, and
//! [`recover_leftovers`] puts the old one back. Every save and every load of a local directory
//! runs that recovery first, so a killed process's leftovers never outlive the next run.
//!
//! On any error the temporary directory is removed (a full disk must not leave gigabytes of
//! `.tmp-*` behind). A save replaces only what saves wrote: each one lists the names it wrote in
//! [`SAVED_NAMES_FILE`], and everything else in the old directory (the user's `training.log`, the
//! TensorBoard event files, `metrics.jsonl`, a note) is carried into the new one as hard links
//! before the swap, so a writer appending to such a file keeps writing into the directory in place
//! and a crash at any point loses none of it. A save's own files of an earlier save that this one
//! does not write (a stale report) are gone afterwards.

use anyhow::{Context, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// The hidden file in a directory saved by [`write_dir_atomically`] that lists, as a JSON array,
/// the names the save wrote: what the next save of that directory may drop. Without it (a
/// directory this program never saved into) the next save keeps every name it does not write.
pub const SAVED_NAMES_FILE: &str = ".saved-names.json";

/// Test hook: `RLHF_FAILPOINT=<name>` aborts the process at the named point, to prove that an
/// interrupted save damages nothing. Points: `checkpoint-before-rename` (the new directory is
/// complete and synced, nothing replaced), `replace-after-exchange` (the directories are
/// swapped, the old one not yet removed), `replace-between-renames` (the fallback's window: the
/// old directory moved away, the new one not yet in), `checkpoint-before-latest`.
pub fn failpoint(name: &str) {
    if std::env::var("RLHF_FAILPOINT").is_ok_and(|v| v == name) {
        eprintln!("failpoint {name}: aborting");
        std::process::abort();
    }
}

/// Test hook: with `RLHF_TEST_NO_EXCHANGE=1` directories are replaced by the two-rename fallback
/// even where `RENAME_EXCHANGE` works, so tests reach the fallback's crash window.
const NO_EXCHANGE_ENV: &str = "RLHF_TEST_NO_EXCHANGE";

/// The names an earlier save of `dir` wrote (empty when it has no readable list: then nothing
/// in it counts as ours). The list is untrusted input: only plain names are taken from it.
fn names_saved_before(dir: &Path) -> HashSet<String> {
    let Ok(text) = std::fs::read_to_string(dir.join(SAVED_NAMES_FILE)) else { return HashSet::new() };
    let names: Vec<String> = serde_json::from_str(&text).unwrap_or_default();
    names.into_iter().filter(|n| Path::new(n).file_name().is_some_and(|f| f == n.as_str())).collect()
}

/// Hard-links everything in the existing `final_dir` that no save wrote and the new directory
/// `new` does not hold into `new` (directories recreated, their contents linked), then lists the
/// names the save wrote in `new`'s [`SAVED_NAMES_FILE`].
fn carry_what_saves_did_not_write(final_dir: &Path, new: &Path) -> Result<()> {
    let mut written: Vec<String> = std::fs::read_dir(new)
        .with_context(|| format!("cannot list {}", new.display()))?
        .map(|e| Ok(e?.file_name().to_string_lossy().to_string()))
        .collect::<std::io::Result<_>>()?;
    written.sort();
    if final_dir.is_dir() {
        let ours = names_saved_before(final_dir);
        for entry in std::fs::read_dir(final_dir).with_context(|| format!("cannot list {}", final_dir.display()))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if name == SAVED_NAMES_FILE || ours.contains(&name) || written.contains(&name) {
                continue;
            }
            link_tree(&entry.path(), &new.join(&name)).with_context(|| {
                format!(
                    "cannot keep {} (not written by a save) in the new {}; nothing was replaced: \
                     save into a directory of its own on a filesystem with hard links",
                    entry.path().display(),
                    final_dir.display()
                )
            })?;
        }
    }
    std::fs::write(new.join(SAVED_NAMES_FILE), serde_json::to_vec(&written)?)
        .with_context(|| format!("cannot write {}", new.join(SAVED_NAMES_FILE).display()))
}

/// `to` becomes a hard link of `from`, or for a directory a new directory of links to its tree.
fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    if std::fs::symlink_metadata(from)?.is_dir() {
        std::fs::create_dir(to)?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            link_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
        Ok(())
    } else {
        // A symbolic link is linked itself, not what it points to (linkat without AT_SYMLINK_FOLLOW).
        std::fs::hard_link(from, to)
    }
}

fn parent_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

fn name_of(path: &Path) -> Result<String> {
    Ok(path.file_name().with_context(|| format!("{} has no file name", path.display()))?.to_string_lossy().to_string())
}

fn sibling(path: &Path, kind: &str) -> Result<PathBuf> {
    Ok(parent_of(path).join(format!(".{kind}-{}-{}", name_of(path)?, std::process::id())))
}

/// A temporary file or directory, removed when dropped unless [`TempPath::commit`]ted.
struct TempPath {
    path: PathBuf,
    committed: bool,
}

impl TempPath {
    fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if !self.committed {
            remove_any(&self.path);
        }
    }
}

fn remove_any(path: &Path) {
    let _ = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(_) => Ok(()),
    };
}

/// Builds `final_dir` by calling `fill` on a temporary sibling, carries over what no save wrote
/// in the previous directory of that name, then puts it in place atomically, replacing the
/// previous one only once the new one is complete and synced. On error nothing is left behind
/// and the previous directory is untouched.
pub fn write_dir_atomically(final_dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = parent_of(final_dir);
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    recover_leftovers(final_dir)?;
    let tmp = TempPath { path: sibling(final_dir, "tmp")?, committed: false };
    remove_any(&tmp.path);
    std::fs::create_dir(&tmp.path).with_context(|| format!("cannot create {}", tmp.path.display()))?;
    fill(&tmp.path)?;
    carry_what_saves_did_not_write(final_dir, &tmp.path)?;
    sync_tree(&tmp.path)?;
    failpoint("checkpoint-before-rename");
    replace_dir(&tmp.path, final_dir)?;
    tmp.commit();
    sync_path(parent)
}

/// Moves the complete directory `new` to `final_dir`, replacing what is there.
fn replace_dir(new: &Path, final_dir: &Path) -> Result<()> {
    if !final_dir.exists() {
        return std::fs::rename(new, final_dir)
            .with_context(|| format!("cannot move the new directory into {}", final_dir.display()));
    }
    if std::env::var_os(NO_EXCHANGE_ENV).is_none() && exchange(new, final_dir)? {
        // `new` now names the old directory.
        failpoint("replace-after-exchange");
        return std::fs::remove_dir_all(new).with_context(|| format!("cannot remove the old {}", new.display()));
    }
    let old = sibling(final_dir, "old")?;
    std::fs::rename(final_dir, &old).with_context(|| format!("cannot move {} aside", final_dir.display()))?;
    failpoint("replace-between-renames");
    if let Err(e) = std::fs::rename(new, final_dir) {
        let _ = std::fs::rename(&old, final_dir);
        return Err(e).with_context(|| format!("cannot move the new directory into {}", final_dir.display()));
    }
    std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove {}", old.display()))
}

/// Swaps two paths atomically. `Ok(false)` where the system or filesystem cannot.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<bool> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).context("a path with a NUL byte");
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths; renameat2 only reads them. The raw syscall works
    // with any C library (glibc gained the wrapper late, musl has none).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS | libc::ENOTSUP) => Ok(false),
        _ => Err(err).with_context(|| format!("cannot swap {} into {}", a.display(), b.display())),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> Result<bool> {
    Ok(false)
}

/// Gives `path`, a file some writer made through a private temporary file (the safetensors
/// crate's `serialize_to_file` renames a 0600 `NamedTempFile` into place), the permissions any
/// new file of ours gets, 0666 less the process's umask: a model's weights are as readable as the
/// config and tokenizer beside it.
pub fn set_created_permissions(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = 0o666 & !umask();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set the permissions of {}", path.display()))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// The process's umask, read where reading does not change it (Linux's /proc/self/status; setting
/// it to read it back would race with other threads creating files); 022 where it cannot be read.
#[cfg(unix)]
fn umask() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = status.lines().find_map(|l| l.strip_prefix("Umask:")).map(str::trim);
    field.and_then(|m| u32::from_str_radix(m, 8).ok()).unwrap_or(0o022)
}

/// Replaces a small file atomically (temporary sibling, fsync, rename, fsync of the directory).
pub fn write_file_atomically(path: &Path, contents: &[u8]) -> Result<()> {
    write_file_atomically_with_mode(path, contents, 0o666)
}

/// [`write_file_atomically`] with the new file's permission bits (less the umask): 0o600 for a
/// file only its user may read. The temporary file is created anew (`O_EXCL`), so nothing placed
/// at its name beforehand, a symbolic link included, is written through.
pub fn write_file_atomically_with_mode(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    recover_leftovers(path)?;
    let tmp = TempPath { path: sibling(path, "tmp")?, committed: false };
    remove_any(&tmp.path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    options.mode(mode);
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options.open(&tmp.path).with_context(|| format!("cannot create {}", tmp.path.display()))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", tmp.path.display()))?;
    drop(file);
    std::fs::rename(&tmp.path, path).with_context(|| format!("cannot replace {}", path.display()))?;
    tmp.commit();
    sync_path(parent_of(path))
}

/// Cleans what killed processes left next to `path` (in its parent directory): their
/// `.tmp-<name>-<pid>` (an unfinished save, or after an exchange the replaced directory) are
/// removed, and an `.old-<name>-<pid>` is put back when `<name>` itself is missing (a crash
/// between the fallback's two renames), else removed. Leftovers of a process that is still
/// running are left alone, this process's too but for `path`'s own (another thread may be
/// writing another file of the directory; two saves of one path at once are not supported).
pub fn recover_leftovers(path: &Path) -> Result<()> {
    let parent = parent_of(path);
    let Ok(entries) = std::fs::read_dir(parent) else { return Ok(()) };
    let own_name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let mut olds = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().to_string();
        let Some((kind, name, pid)) = leftover(&file_name) else { continue };
        let alive = if pid == std::process::id() { name != own_name } else { process_alive(pid) };
        if alive {
            continue;
        }
        match kind {
            "old" => olds.push((entry.path(), parent.join(name))),
            _ => remove_any(&entry.path()),
        }
    }
    for (old, original) in olds {
        if std::fs::symlink_metadata(&original).is_err() {
            std::fs::rename(&old, &original).with_context(|| {
                format!("cannot restore {} from {} (an interrupted save)", original.display(), old.display())
            })?;
            eprintln!("warning: restored {} from an interrupted save ({})", original.display(), old.display());
        } else {
            remove_any(&old);
        }
    }
    Ok(())
}

/// `.tmp-<name>-<pid>` or `.old-<name>-<pid>`, as ("tmp" | "old", name, pid).
fn leftover(file_name: &str) -> Option<(&str, &str, u32)> {
    let (kind, rest) = file_name.strip_prefix('.')?.split_once('-')?;
    let (name, pid) = rest.rsplit_once('-')?;
    let pid = pid.parse().ok().filter(|_| pid.bytes().all(|b| b.is_ascii_digit()))?;
    (matches!(kind, "tmp" | "old") && !name.is_empty()).then_some((kind, name, pid))
}

#[cfg(unix)]
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(not(unix))]
fn process_alive(_: u32) -> bool {
    true
}

/// fsyncs `path` (a file or a directory).
pub fn sync_path(path: &Path) -> Result<()> {
    let path = if path.as_os_str().is_empty() { Path::new(".") } else { path };
    std::fs::File::open(path).and_then(|f| f.sync_all()).with_context(|| format!("cannot flush {}", path.display()))
}

/// fsyncs every file and directory below `dir`, then `dir` itself.
pub fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            sync_tree(&entry.path())?;
        } else if !kind.is_symlink() {
            // A symbolic link is synced with its directory (and may point nowhere).
            sync_path(&entry.path())?;
        }
    }
    sync_path(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::bail;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
        v.sort();
        v
    }

    fn write(dir: &Path, files: &[(&str, &str)]) -> Result<()> {
        for (n, c) in files {
            std::fs::write(dir.join(n), c)?;
        }
        Ok(())
    }

    /// A file made private by its writer gets what a plain new file gets: 0666 less the umask.
    #[cfg(unix)]
    #[test]
    fn a_privately_written_file_gets_a_new_files_permissions() -> Result<()> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let dir = tempfile::tempdir()?;
        let (private, plain) = (dir.path().join("weights"), dir.path().join("config.json"));
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&private)?;
        std::fs::write(&plain, b"{}")?;
        set_created_permissions(&private)?;
        let mode = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777);
        assert_eq!(mode(&private)?, mode(&plain)?);
        assert_eq!(mode(&plain)?, 0o666 & !umask(), "the umask read is the one the kernel applied");
        Ok(())
    }

    #[test]
    fn a_replacement_holds_exactly_what_the_save_wrote() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("model");
        write_dir_atomically(&dir, |d| write(d, &[("weights", "old"), ("reward_eval.json", "stale")]))?;
        write_dir_atomically(&dir, |d| write(d, &[("weights", "new")]))?;
        assert_eq!(names(&dir), [SAVED_NAMES_FILE, "weights"], "nothing the earlier save wrote is carried over");
        assert_eq!(std::fs::read_to_string(dir.join("weights"))?, "new");
        assert_eq!(std::fs::read_to_string(dir.join(SAVED_NAMES_FILE))?, r#"["weights"]"#);
        assert_eq!(names(root.path()), ["model"], "no temporary or old directory is left");
        Ok(())
    }

    #[test]
    fn files_no_save_wrote_survive_every_save_and_keep_receiving_writes() -> Result<()> {
        use std::io::Write;
        let root = tempfile::tempdir()?;
        // DS-Chat's scripts: `--output_dir $OUT --tensorboard_path $OUT &> $OUT/training.log`,
        // a directory this program has never saved into.
        let dir = root.path().join("out");
        std::fs::create_dir_all(dir.join("tb/run"))?;
        let log_path = dir.join("training.log");
        let mut log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
        writeln!(log, "before")?;
        write(&dir, &[("notes.txt", "mine"), ("weights", "a user's file of a name the save writes")])?;
        write(&dir.join("tb/run"), &[("events.out.tfevents.1", "e")])?;
        std::os::unix::fs::symlink("/nonexistent/target", dir.join("dangling"))?;
        for round in ["1", "2"] {
            write_dir_atomically(&dir, |d| write(d, &[("weights", round)]))?;
            writeln!(log, "after save {round}")?;
        }
        assert_eq!(std::fs::read_to_string(&log_path)?, "before\nafter save 1\nafter save 2\n");
        assert_eq!(names(&dir), [SAVED_NAMES_FILE, "dangling", "notes.txt", "tb", "training.log", "weights"]);
        assert_eq!(std::fs::read_to_string(dir.join("weights"))?, "2", "a name the save writes is the save's");
        assert_eq!(std::fs::read_to_string(dir.join("notes.txt"))?, "mine");
        assert_eq!(std::fs::read_to_string(dir.join("tb/run/events.out.tfevents.1"))?, "e");
        assert_eq!(std::fs::read_link(dir.join("dangling"))?, Path::new("/nonexistent/target"));
        assert_eq!(names(root.path()), ["out"]);
        Ok(())
    }

    #[test]
    fn an_unreadable_list_of_saved_names_keeps_everything() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("model");
        std::fs::create_dir(&dir)?;
        write(&dir, &[(SAVED_NAMES_FILE, "{not json"), ("report.json", "r")])?;
        write_dir_atomically(&dir, |d| write(d, &[("weights", "1")]))?;
        assert_eq!(names(&dir), [SAVED_NAMES_FILE, "report.json", "weights"]);
        // A list naming paths outside the directory gives them no meaning.
        write(&dir, &[(SAVED_NAMES_FILE, r#"["../model", "/etc", "report.json/..", "weights"]"#)])?;
        write_dir_atomically(&dir, |d| write(d, &[("weights", "2")]))?;
        assert_eq!(names(&dir), [SAVED_NAMES_FILE, "report.json", "weights"]);
        Ok(())
    }

    #[test]
    fn a_failing_save_leaves_no_temporary_directory_and_the_old_one_intact() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("model");
        write_dir_atomically(&dir, |d| write(d, &[("weights", "old")]))?;
        let err = write_dir_atomically(&dir, |d| {
            write(d, &[("weights", "half")])?;
            bail!("No space left on device (a failing writer)")
        })
        .unwrap_err();
        assert!(err.to_string().contains("No space left"), "{err}");
        assert_eq!(names(root.path()), ["model"], "the temporary directory is removed on error");
        assert_eq!(std::fs::read_to_string(dir.join("weights"))?, "old");
        // Also for a first save, where there is no old directory.
        let fresh = root.path().join("fresh");
        assert!(write_dir_atomically(&fresh, |_| bail!("disk full")).is_err());
        assert_eq!(names(root.path()), ["model"]);
        Ok(())
    }

    /// Threads writing different files of one directory at once (wandb's run file and its stream
    /// offset) never take each other's temporary file for a dead save's.
    #[test]
    fn threads_saving_different_files_of_one_directory_do_not_disturb_each_other() -> Result<()> {
        let root = tempfile::tempdir()?;
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let path = root.path().join(format!("file-{t}"));
                std::thread::spawn(move || -> Result<()> {
                    for i in 0..200 {
                        write_file_atomically(&path, format!("{t} {i}").as_bytes())?;
                    }
                    Ok(())
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a writer thread panicked")?;
        }
        assert_eq!(names(root.path()), ["file-0", "file-1", "file-2", "file-3"]);
        assert_eq!(std::fs::read_to_string(root.path().join("file-3"))?, "3 199");
        Ok(())
    }

    #[test]
    fn leftovers_of_dead_processes_are_recovered() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("model");
        // A pid that cannot be running: above the kernel's pid_max (at most 2^22).
        let dead = 1u32 << 23;
        // The fallback's window: the old directory moved away, the new one not yet in.
        std::fs::create_dir(root.path().join(format!(".old-model-{dead}")))?;
        write(&root.path().join(format!(".old-model-{dead}")), &[("weights", "old")])?;
        std::fs::create_dir(root.path().join(format!(".tmp-model-{dead}")))?;
        std::fs::write(root.path().join(format!(".tmp-latest-{dead}")), "iter_")?;
        // This process's own leftover is stale (saves are not concurrent within a process); a
        // running process's save in progress (pid 1 is always running) is not touched; names
        // without a pid are not ours.
        std::fs::create_dir(root.path().join(format!(".tmp-model-{}", std::process::id())))?;
        std::fs::create_dir(root.path().join(".tmp-model-1"))?;
        std::fs::create_dir(root.path().join(".tmp-model-x"))?;
        // A user's hidden files that only look like ours: another kind, or no name before the pid.
        std::fs::create_dir(root.path().join(format!(".bak-model-{dead}")))?;
        std::fs::write(root.path().join(format!(".tmp--{dead}")), "mine")?;
        recover_leftovers(&dir)?;
        assert_eq!(std::fs::read_to_string(dir.join("weights"))?, "old", "the old directory is restored");
        let kept =
            [format!(".bak-model-{dead}"), format!(".tmp--{dead}"), ".tmp-model-1".into(), ".tmp-model-x".into()];
        assert_eq!(names(root.path()), [&kept[..], &["model".to_string()]].concat());
        Ok(())
    }

    #[test]
    fn a_path_that_cannot_be_synced_is_an_error() -> Result<()> {
        let root = tempfile::tempdir()?;
        let missing = root.path().join("missing");
        let e = format!("{:#}", sync_path(&missing).unwrap_err());
        assert!(e.contains("cannot flush") && e.contains("missing"), "{e}");
        let e = format!("{:#}", sync_tree(&missing).unwrap_err());
        assert!(e.contains("cannot list") && e.contains("missing"), "{e}");
        Ok(())
    }
}
