//! The password of a machine in a netrc file, as curl and Python's `netrc` read one: tokens
//! separated by white space, a token in double quotes may hold white space and the escapes `\"`,
//! `\\`, `\n`, `\r`, `\t`; `#` starts a comment that runs to the end of its line; `macdef NAME`
//! starts a macro whose lines run to the next empty line; entries are `machine HOST` or
//! `default`, followed by `login`, `password`, `account` or `port` with a value each.

use std::path::Path;

/// The password of `host`'s entry in the netrc file at `path` (the `default` entry where no
/// machine entry names the host, as curl takes it); None where the file or the entry is missing.
pub fn password(path: &Path, host: &str) -> Option<String> {
    password_in(&std::fs::read_to_string(path).ok()?, host)
}

fn password_in(text: &str, host: &str) -> Option<String> {
    let tokens = tokens(text);
    let mut tokens = tokens.iter().map(String::as_str);
    // (the entry's host, None for `default`) and its password.
    let mut entries: Vec<(Option<&str>, Option<&str>)> = Vec::new();
    while let Some(keyword) = tokens.next() {
        match keyword {
            "machine" => entries.push((Some(tokens.next()?), None)),
            "default" => entries.push((None, None)),
            "password" => {
                let value = tokens.next()?;
                if let Some(entry) = entries.last_mut() {
                    entry.1 = Some(value);
                }
            }
            "login" | "account" | "port" => {
                tokens.next()?;
            }
            _ => {} // an unknown token: skipped, as curl skips it
        }
    }
    let named = entries.iter().find(|(machine, _)| *machine == Some(host));
    let entry = named.or_else(|| entries.iter().find(|(machine, _)| machine.is_none()))?;
    entry.1.map(str::to_string)
}

/// The file's tokens, comments and macro definitions left out, quotes and escapes resolved.
fn tokens(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let (mut out, mut i) = (Vec::new(), 0);
    let line_end = |from: usize| chars[from..].iter().position(|&c| c == '\n').map_or(chars.len(), |n| from + n);
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            i = line_end(i);
        } else if c == '"' {
            let mut token = String::new();
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    i += 1;
                    token.push(match chars[i] {
                        'n' => '\n',
                        'r' => '\r',
                        't' => '\t',
                        other => other,
                    });
                } else {
                    token.push(chars[i]);
                }
                i += 1;
            }
            out.push(token);
            i += 1; // the closing quote
        } else {
            let start = i;
            while i < chars.len() && !chars[i].is_whitespace() {
                i += 1;
            }
            let token: String = chars[start..i].iter().collect();
            if token == "macdef" {
                // The macro's name and lines, up to an empty line.
                while i < chars.len() && !(chars[i] == '\n' && chars.get(i + 1) == Some(&'\n')) {
                    i += 1;
                }
                continue;
            }
            out.push(token);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_entry_of_the_host_gives_its_password() {
        let text = "machine example.com login a password nope\nmachine api.wandb.ai\n  login user\n  password s3cret\n";
        assert_eq!(password_in(text, "api.wandb.ai").as_deref(), Some("s3cret"));
        assert_eq!(password_in(text, "example.com").as_deref(), Some("nope"));
        assert_eq!(password_in(text, "other.org"), None);
    }

    #[test]
    fn quoted_values_comments_and_macros_are_read_as_curl_reads_them() {
        let text = concat!(
            "# a comment: machine api.wandb.ai password wrong\n",
            "macdef init\ncd /tmp\nmachine api.wandb.ai password in-a-macro\n\n",
            "machine api.wandb.ai login \"a user\" password \"p w \\\"q\\\" \\\\ end\"\n",
        );
        assert_eq!(password_in(text, "api.wandb.ai").as_deref(), Some("p w \"q\" \\ end"));
    }

    #[test]
    fn a_password_spelled_like_a_keyword_is_a_value() {
        let text = "machine a.io password machine\nmachine b.io password default\n";
        assert_eq!(password_in(text, "a.io").as_deref(), Some("machine"));
        assert_eq!(password_in(text, "b.io").as_deref(), Some("default"));
    }

    #[test]
    fn a_login_account_or_port_spelled_like_a_keyword_is_a_value() {
        let text = "machine a.io login machine account password port default password real\n";
        assert_eq!(password_in(text, "a.io").as_deref(), Some("real"));
        assert_eq!(password_in(text, "machine"), None);
    }

    #[test]
    fn a_quote_left_open_runs_to_the_end_of_the_file() {
        assert_eq!(password_in("machine a.io password \"p w", "a.io").as_deref(), Some("p w"));
        // A backslash with nothing after it is itself.
        assert_eq!(password_in("machine a.io password \"p\\", "a.io").as_deref(), Some("p\\"));
        assert_eq!(password_in("machine a.io password \"\\n\\t\\r\\x\"", "a.io").as_deref(), Some("\n\t\rx"));
    }

    #[test]
    fn the_last_token_of_a_file_without_a_final_newline_is_read() {
        assert_eq!(password_in("machine a.io password p", "a.io").as_deref(), Some("p"));
        // A macro may run to the end of the file, and an empty quoted value is a value.
        let text = "machine a.io login \"\" password p\nmacdef init\ncd /tmp";
        assert_eq!(password_in(text, "a.io").as_deref(), Some("p"));
    }

    #[test]
    fn the_default_entry_serves_hosts_without_their_own() {
        let text = "machine a.io password one\ndefault login anyone password fallback\n";
        assert_eq!(password_in(text, "b.io").as_deref(), Some("fallback"));
        assert_eq!(password_in(text, "a.io").as_deref(), Some("one"));
    }
}
