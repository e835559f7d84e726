//! The panic hook every binary installs (`hybrid_engine::runtime::init`): a panic anywhere, on
//! the main thread or a worker, is one `error:` line naming it a bug and exit code 101, with the
//! backtrace only under `RUST_BACKTRACE`. Triggered through the `RLHF_TEST_PANIC` test hook.

use std::process::{Command, Output};

fn run_with_test_panic(binary: &str, where_: &str, rust_backtrace: Option<&str>) -> Output {
    let mut command = Command::new(binary);
    command.arg("--help").env("RLHF_TEST_PANIC", where_).env_remove("RUST_BACKTRACE");
    if let Some(v) = rust_backtrace {
        command.env("RUST_BACKTRACE", v);
    }
    command.output().expect("spawn the binary")
}

#[test]
fn a_panic_on_any_thread_is_one_line_naming_a_bug_and_exit_101() {
    for binary in [env!("CARGO_BIN_EXE_train"), env!("CARGO_BIN_EXE_chat")] {
        for where_ in ["main", "thread"] {
            let out = run_with_test_panic(binary, where_, None);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(101), "{binary} {where_}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{binary} {where_}: one line, got:\n{stderr}");
            assert!(
                stderr.starts_with("error: internal error (a bug, please report it): RLHF_TEST_PANIC=")
                    && stderr.contains("deliberate panic")
                    && stderr.contains("runtime.rs:"),
                "{binary} {where_}: {stderr}"
            );
            assert!(out.stdout.is_empty(), "the panic comes before --help is handled");
        }
    }
}

#[test]
fn the_backtrace_follows_only_when_rust_backtrace_asks() {
    let binary = env!("CARGO_BIN_EXE_chat");
    let quiet = run_with_test_panic(binary, "thread", Some("0"));
    assert_eq!(String::from_utf8_lossy(&quiet.stderr).lines().count(), 1);
    let traced = run_with_test_panic(binary, "thread", Some("1"));
    let stderr = String::from_utf8_lossy(&traced.stderr);
    assert_eq!(traced.status.code(), Some(101), "{stderr}");
    assert!(stderr.lines().count() > 3 && stderr.contains(" 0: "), "numbered backtrace frames:\n{stderr}");
}

#[test]
fn other_values_of_the_test_hook_do_nothing() {
    let out = run_with_test_panic(env!("CARGO_BIN_EXE_chat"), "1", None);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--path"), "--help ran");
}
