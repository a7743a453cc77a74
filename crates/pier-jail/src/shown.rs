//! A command's arguments as logs and panics show them (`Debug`): as given, but the value of a
//! flag that names a secret (`--api-key=<redacted>`, and the argument after a bare `--token`).
//! Used wherever an agent's command is shown (the jail's `Program`, `pier-client`'s agents).

use std::fmt;

/// `Debug` of arguments, secrets left out.
pub struct Args<'a>(pub &'a [String]);

/// Whether `flag` (an argument starting with `-`) names something secret.
fn secret_flag(flag: &str) -> bool {
    let flag = flag.to_ascii_lowercase();
    flag.starts_with('-') && ["key", "token", "secret", "password", "passwd", "auth"].iter().any(|w| flag.contains(w))
}

impl fmt::Debug for Args<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        let mut value_of_secret = false;
        for arg in self.0 {
            let shown = match arg.split_once('=') {
                _ if value_of_secret => "<redacted>".to_owned(),
                Some((flag, _)) if secret_flag(flag) => format!("{flag}=<redacted>"),
                _ => arg.clone(),
            };
            value_of_secret = !value_of_secret && !arg.contains('=') && secret_flag(arg);
            list.entry(&shown);
        }
        list.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::Args;

    #[test]
    fn a_secret_flag_s_value_is_not_shown() {
        let args = ["--model", "m", "--api-key=sk-1", "--Token", "tok-2", "-v", "--auth", "--x"].map(String::from);
        assert_eq!(
            format!("{:?}", Args(&args)),
            r#"["--model", "m", "--api-key=<redacted>", "--Token", "<redacted>", "-v", "--auth", "<redacted>"]"#
        );
    }
}
