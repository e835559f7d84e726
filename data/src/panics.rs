//! Containing panics of third-party readers. The `parquet` crate panics on some malformed files
//! (e.g. "column start and length should not be negative" from a corrupt footer), and the
//! `tokenizers` crate on some malformed `tokenizer.json` sections (a decoder it cannot parse),
//! instead of returning an error; such a panic is not our bug but bad input, so the reader boundary catches
//! it and reports one line naming the file. While [`contain`] runs, [`panic_is_contained`] is
//! true on that thread, which the process's panic hook (`hybrid_engine::runtime`) reads to stay
//! silent and let the unwinding reach the catch.

use anyhow::{anyhow, Result};
use std::cell::Cell;

thread_local! {
    static CONTAINING: Cell<u32> = const { Cell::new(0) };
}

/// Whether a panic on this thread now is caught by [`contain`].
pub fn panic_is_contained() -> bool {
    CONTAINING.with(|c| c.get() > 0)
}

/// Runs `read` and turns a panic inside it into an error: `what` names the input, e.g. the file.
pub fn contain<T>(what: &str, read: impl FnOnce() -> Result<T>) -> Result<T> {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            CONTAINING.with(|c| c.set(c.get() - 1));
        }
    }
    CONTAINING.with(|c| c.set(c.get() + 1));
    let _depth = Depth;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)) {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default()
                .replace('\n', " ");
            Err(anyhow!("{what} is malformed (the reader failed: {message}); check or re-download the file"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_one_error_line_and_the_flag_follows_the_scope() {
        assert!(!panic_is_contained());
        let err = contain("bad.parquet", || -> Result<()> {
            assert!(panic_is_contained());
            panic!("column start\nand length")
        })
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "bad.parquet is malformed (the reader failed: column start and length); check or re-download the file"
        );
        assert!(!panic_is_contained(), "the flag is cleared after a panic too");
        assert_eq!(contain("ok", || Ok(3)).unwrap(), 3);
    }
}
