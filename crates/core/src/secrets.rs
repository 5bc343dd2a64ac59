//! Secrets kept out of what the daemon tells. A command line is its process's own choice and
//! often carries a credential (`--api-key sk-...`, `HF_TOKEN=...`, `-H Authorization: Bearer
//! ...`, `curl -u user:password`); what the daemon tells (events, webhooks, logs, the
//! world-readable history) reaches other accounts and outlives the process. Every command line
//! leaves through `masked`: the flight recorder's records, and `Shown` (what alerts and events
//! carry) is made by it alone.

use serde::Serialize;

/// Characters of a command line an alert or event carries at most.
const SHOWN_CHARS: usize = 1024;

/// Parts of an argument's name that say its value is a secret (`--api-key`, `HF_TOKEN`,
/// `--db-password`, `GH_PAT`; not `--max-tokens` or `--tokenizer`). Names are cut into parts at
/// every character that is not a letter or a digit, and compared without case.
const SECRET_PARTS: [&str; 22] = [
    "key",
    "keys",
    "apikey",
    "apikeys",
    "token",
    "secret",
    "secrets",
    "password",
    "passwd",
    "pass",
    "pwd",
    "passphrase",
    "auth",
    "authorization",
    "credential",
    "credentials",
    "cookie",
    "jwt",
    "bearer",
    "pat",
    "sig",
    "signature",
];

/// Endings that make a part of a name a secret's, for names written in one word (`--authtoken`,
/// `--secretkey`, `--accesstoken`, `PGPASSWORD`, `clientSecret`).
const SECRET_ENDINGS: [&str; 9] = [
    "key",
    "keys",
    "token",
    "secret",
    "password",
    "passwd",
    "pwd",
    "passphrase",
    "credentials",
];

/// Authorization schemes: the word after one is the credential (`Bearer X`, `token X`).
const SCHEMES: [&str; 4] = ["bearer", "basic", "token", "digest"];

/// Flags whose value is `user:password` (curl's `-u`, `--user`, `--proxy-user`; `-U`).
const CREDENTIAL_FLAGS: [&str; 4] = ["-u", "--user", "-U", "--proxy-user"];

/// Short flags whose value is a password for one program: (program, flag, whether the value
/// may be the next word; it may always be attached, `-pX`). `mysql -p` alone asks for it.
const PASSWORD_FLAGS: [(&str, &str, bool); 6] = [
    ("redis-cli", "-a", true),
    ("sshpass", "-p", true),
    ("mysql", "-p", false),
    ("mariadb", "-p", false),
    ("mysqldump", "-p", false),
    ("mysqladmin", "-p", false),
];

/// A command line as the daemon tells it, secrets masked as `***`: the value of an argument whose
/// name says it is one (`--api-key X`, `--token=X`, `HF_TOKEN=X`, `X-Api-Key: X`, `X-Api-Key:X`,
/// also inside another argument's value, `--header=X-Auth-Token:X`), the credential after an
/// authorization scheme (`Bearer X`), the password of `-u user:X` and of the password flags of
/// a few programs (`redis-cli -a X`, `mysql -pX`), the user and password of a URL
/// (`postgres://***@host`) and its query's secrets (`?token=***`). Model matchers read the rest.
/// (Not caught: secrets in JSON arguments or of other programs' short flags.)
pub fn masked(cmdline: &str) -> String {
    let words: Vec<&str> = cmdline.split(' ').collect();
    let program = words
        .first()
        .map_or("", |w| w.rsplit('/').next().unwrap_or(w));
    let mut out: Vec<String> = Vec::with_capacity(words.len());
    let mut next = Next::Plain;
    for word in words {
        // Several spaces in a row: what the next word is does not change.
        if word.is_empty() {
            out.push(String::new());
            continue;
        }
        let (shown, after) = match next {
            // A long flag is not a value: the secret's name was a switch (`--no-auth`).
            Next::Secret if word.starts_with("--") => masked_word(word, program),
            Next::Secret => secret_value(word),
            Next::Password => (password_masked(word), Next::Plain),
            Next::Plain => masked_word(word, program),
        };
        out.push(shown);
        next = after;
    }
    out.join(" ")
}

/// A command line fit to leave the daemon in an alert or an event: `masked`, at most
/// `SHOWN_CHARS` characters. Made only from the raw command line, by `Shown::of`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Shown(String);

impl Shown {
    pub fn of(cmdline: &str) -> Shown {
        Shown(masked(cmdline).chars().take(SHOWN_CHARS).collect())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the next word of a command line is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Plain,
    /// A secret (or an authorization scheme, then the secret).
    Secret,
    /// `user:password`.
    Password,
}

/// Whether an argument named `name` (`--api-key`, `HF_TOKEN`, `X-Auth-Token`) holds a secret.
fn secret_name(name: &str) -> bool {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|part| !part.is_empty())
        .any(|part| {
            let part = part.to_ascii_lowercase();
            SECRET_PARTS.contains(&part.as_str())
                || SECRET_ENDINGS
                    .iter()
                    .any(|end| part.len() > end.len() && part.ends_with(end))
        })
}

/// Whether `text` can be the name of an argument, a variable or a header (`--api-key`,
/// `HF_TOKEN`, `X-Api-Key`): not a path, a URL or an address.
fn name_like(text: &str) -> bool {
    text.chars().any(|c| c.is_ascii_alphabetic())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The word after a secret's name: masked, but an authorization scheme stays and the word
/// after it goes.
fn secret_value(word: &str) -> (String, Next) {
    if SCHEMES.contains(&word.to_ascii_lowercase().as_str()) {
        (word.to_string(), Next::Secret)
    } else {
        ("***".into(), Next::Plain)
    }
}

/// `user:password` with the password masked; a value without one as it is.
fn password_masked(word: &str) -> String {
    match word.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => word.to_string(),
    }
}

/// One word of a command line, and what the next one is.
fn masked_word(word: &str, program: &str) -> (String, Next) {
    // `NAME=value`: a variable, or a flag with its value attached.
    if let Some((name, value)) = word.split_once('=') {
        if name_like(name) {
            if secret_name(name) {
                let next = if value.is_empty() {
                    Next::Secret
                } else {
                    Next::Plain
                };
                return (format!("{name}=***"), next);
            }
            if CREDENTIAL_FLAGS.contains(&name) {
                return (format!("{name}={}", password_masked(value)), Next::Plain);
            }
            // Another flag's value may hold a header or a URL (`--header=X-Auth-Token:X`).
            let (value, next) = masked_value(value);
            return (format!("{name}={value}"), next);
        }
    }
    if word.starts_with('-') {
        if let Some(&(_, flag, separate)) = PASSWORD_FLAGS
            .iter()
            .find(|(p, flag, _)| *p == program && word.starts_with(flag))
        {
            if word == flag {
                let next = if separate { Next::Secret } else { Next::Plain };
                return (word.to_string(), next);
            }
            return (format!("{flag}***"), Next::Plain);
        }
        if CREDENTIAL_FLAGS.contains(&word) {
            return (word.to_string(), Next::Password);
        }
        if !word.contains(':') && secret_name(word) {
            return (word.to_string(), Next::Secret);
        }
    }
    masked_value(word)
}

/// A value that may be a header (`X-Api-Key:X`, `Authorization:` before `Bearer X`), a URL, or
/// an authorization scheme before its credential; and what the next word is.
fn masked_value(value: &str) -> (String, Next) {
    if SCHEMES[..2].contains(&value.to_ascii_lowercase().as_str()) {
        return (value.to_string(), Next::Secret);
    }
    if let Some((name, rest)) = value.split_once(':') {
        if name_like(name) && !rest.starts_with("//") && secret_name(name) {
            return match rest {
                "" => (value.to_string(), Next::Secret),
                _ if SCHEMES.contains(&rest.to_ascii_lowercase().as_str()) => {
                    (value.to_string(), Next::Secret)
                }
                _ => (format!("{name}:***"), Next::Plain),
            };
        }
    }
    (url_masked(value), Next::Plain)
}

/// `word` with the user and password of a URL in it masked (`scheme://***@host`), and the
/// values of its query's secrets (`?token=***`).
fn url_masked(word: &str) -> String {
    let Some(scheme_end) = word.find("://") else {
        return word.to_string();
    };
    let rest = &word[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, after) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => format!("***{}", &authority[at..]),
        None => authority.to_string(),
    };
    let after = match after.split_once('?') {
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, Some(f)),
                None => (query, None),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if secret_name(name) => format!("{name}=***"),
                    _ => pair.to_string(),
                })
                .collect();
            let fragment = fragment.map_or(String::new(), |f| format!("#{f}"));
            format!("{path}?{}{fragment}", query.join("&"))
        }
        None => after.to_string(),
    };
    format!("{}://{authority}{after}", &word[..scheme_end])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Secrets on a command line stay out of what the daemon tells; the rest stays as it is.
    #[test]
    fn secret_arguments_are_masked() {
        let cases = [
            (
                "vllm serve meta-llama/Llama-3-8B --api-key sk-123 --port 8000 --hf-token=hf_abc HF_TOKEN=hf_def",
                "vllm serve meta-llama/Llama-3-8B --api-key *** --port 8000 --hf-token=*** HF_TOKEN=***",
            ),
            // A value that looks like a flag, and one after an empty `=`.
            ("server --api-key -abc --x", "server --api-key *** --x"),
            ("server --api-key= sk-1 --x", "server --api-key=*** *** --x"),
            ("server --db-password hunter2", "server --db-password ***"),
            // Several spaces before the value.
            ("server --api-key  sk-1 --x", "server --api-key  *** --x"),
            (
                "curl -H Authorization: Bearer eyJhbGci",
                "curl -H Authorization: Bearer ***",
            ),
            ("worker postgres://app:pw@db:5432/x", "worker postgres://***@db:5432/x"),
            ("git clone https://user:tok@github.com/a/b", "git clone https://***@github.com/a/b"),
            // Not secrets: kept for the model matchers.
            ("vllm serve m --max-tokens 512 --tokenizer t", "vllm serve m --max-tokens 512 --tokenizer t"),
            ("python3 train.py --lr 3e-4 https://example.com/a@b", "python3 train.py --lr 3e-4 https://example.com/a@b"),
            (
                "vllm serve m --max-num-batched-tokens 2048 --ssl-keyfile /etc/k.pem --host localhost:8000",
                "vllm serve m --max-num-batched-tokens 2048 --ssl-keyfile /etc/k.pem --host localhost:8000",
            ),
        ];
        for (given, kept) in cases {
            assert_eq!(masked(given), kept, "{given}");
        }
    }

    /// Round four: the spellings the masking missed, and `--header=X-Auth-Token:x` kept while
    /// the next argument was masked instead.
    #[test]
    fn every_spelling_of_a_secret_is_masked() {
        let cases = [
            (
                "vllm serve m --api-keys k1 --port 1",
                "vllm serve m --api-keys *** --port 1",
            ),
            (
                "ngrok http 80 --authtoken t1",
                "ngrok http 80 --authtoken ***",
            ),
            (
                "srv --apitoken t2 --secretkey s3 --accesstoken a4",
                "srv --apitoken *** --secretkey *** --accesstoken ***",
            ),
            (
                "curl -H X-Api-Key: v1 http://h/",
                "curl -H X-Api-Key: *** http://h/",
            ),
            (
                "curl -H X-Api-Key:v1 http://h/",
                "curl -H X-Api-Key:*** http://h/",
            ),
            (
                "env PGPASSWORD=pw psql -h db",
                "env PGPASSWORD=*** psql -h db",
            ),
            (
                "env GH_PAT=ghp_1 gh repo list",
                "env GH_PAT=*** gh repo list",
            ),
            ("curl -u user:pw http://h/", "curl -u user:*** http://h/"),
            (
                "curl --user=user:pw http://h/",
                "curl --user=user:*** http://h/",
            ),
            (
                "/usr/bin/redis-cli -a pw ping",
                "/usr/bin/redis-cli -a *** ping",
            ),
            ("redis-cli -apw ping", "redis-cli -a*** ping"),
            ("mysql -uroot -psecret db", "mysql -uroot -p*** db"),
            ("mysql -p db", "mysql -p db"),
            (
                "curl -H Authorization:Bearer x1 http://h/",
                "curl -H Authorization:Bearer *** http://h/",
            ),
            (
                "curl -H Authorization: token x2",
                "curl -H Authorization: token ***",
            ),
            (
                "curl --header=X-Auth-Token:x3 http://h/",
                "curl --header=X-Auth-Token:*** http://h/",
            ),
            (
                "curl --header X-Auth-Token:x4 http://h/",
                "curl --header X-Auth-Token:*** http://h/",
            ),
            (
                "curl --header=Authorization: Bearer x5 http://h/",
                "curl --header=Authorization: Bearer *** http://h/",
            ),
            ("s --clientSecret c1", "s --clientSecret ***"),
            (
                "wget https://b.example/f?sv=1&sig=abc&token=t#top",
                "wget https://b.example/f?sv=1&sig=***&token=***#top",
            ),
            (
                "aws s3 cp https://s3/x?X-Amz-Signature=abc .",
                "aws s3 cp https://s3/x?X-Amz-Signature=*** .",
            ),
            // A switch named like a secret takes no value from the next flag.
            ("srv --no-auth --port 8000", "srv --no-auth --port 8000"),
            // Not secrets.
            ("sudo -u vllm vllm serve m", "sudo -u vllm vllm serve m"),
            ("ps -u root", "ps -u root"),
            ("ssh -p 22 host", "ssh -p 22 host"),
            ("ls -a /tmp", "ls -a /tmp"),
        ];
        for (given, kept) in cases {
            assert_eq!(masked(given), kept, "{given}");
        }
    }

    #[test]
    fn what_is_shown_is_masked_and_bounded() {
        let long = format!("srv --api-key sk-1 {}", "x".repeat(2000));
        let shown = Shown::of(&long);
        assert!(shown.as_str().starts_with("srv --api-key *** x"));
        assert_eq!(shown.as_str().chars().count(), SHOWN_CHARS);
        assert_eq!(
            serde_json::to_string(&Shown::of("a --token t")).unwrap(),
            "\"a --token ***\""
        );
    }
}
