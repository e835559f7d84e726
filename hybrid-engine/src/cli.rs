//! Command-line conventions shared by every binary: a usage mistake is one `error:` line and
//! exit code 2 (clap's multi-line usage block is left to `--help`); a repeated flag overrides
//! the earlier one, so scripts can append to a base command.

use clap::Parser;

/// Parses the process arguments, or prints one error line (or the help) and exits.
pub fn parse_or_exit<T: Parser>() -> T {
    match T::try_parse() {
        Ok(args) => args,
        Err(e) => {
            use clap::error::ErrorKind::{DisplayHelp, DisplayHelpOnMissingArgumentOrSubcommand, DisplayVersion};
            if matches!(e.kind(), DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand) {
                e.exit();
            }
            let rendered = e.to_string();
            let first = rendered.lines().next().unwrap_or("error: invalid arguments").trim_end();
            eprintln!("{first} (see --help)");
            std::process::exit(2);
        }
    }
}

/// Prints an error chain as one line and exits with code 2.
pub fn exit_with(err: anyhow::Error) -> ! {
    let text = format!("{err:#}").replace('\n', " ");
    eprintln!("error: {text}");
    std::process::exit(2);
}
