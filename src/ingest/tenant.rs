//! The tenant id rule, one for every place a tenant is named: a record's `ce-tenantid` (ingest's
//! `invalid_tenant`), a token's `tenant_id`, a request's `?tenant_id=` or body, an apply file and
//! the `token` command ([`crate::api::auth::valid_tenant`] is [`check_tenant`]).
//!
//! A tenant id keys the inbox, every store and every token, and is compared byte for byte, so two
//! ids that look the same would be two tenants: a receiver, an operator reading a log or a token
//! could take one for the other. An id is therefore 1 to [`MAX_TENANT_BYTES`] bytes of UTF-8
//! holding no character that shows as a blank or as nothing at all:
//! - Unicode `White_Space` but the ASCII space (tab, U+00A0, U+2028, U+3000, …), and no leading
//!   or trailing blank, the ASCII space included (one inside, `acme ltda`, is taken: ids written
//!   that way before keep working);
//! - control characters (`Cc`);
//! - format characters (`Cf`: U+200B, U+200E, U+202E, U+2060, U+FEFF, U+E0001, …) and the other
//!   `Default_Ignorable_Code_Point`s (U+034F, U+115F, U+3164, variation selectors, …).
//!
//! Checking an ASCII id reads its bytes once; others go through one pattern compiled on first use.
use std::sync::LazyLock;

/// The longest tenant id the hub takes, from a record (`ce-tenantid`), a token, a body or an apply
/// file: it keys the inbox, every store and every token.
pub const MAX_TENANT_BYTES: usize = 256;

/// The rule in words, for errors shown to API clients and the `token` command.
pub const TENANT_RULE: &str = "1-256 bytes, no leading or trailing whitespace, and no whitespace but the ASCII space, \
     control, format or other invisible character";

/// Why a string is not a tenant id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantFault {
    Empty,
    /// Over [`MAX_TENANT_BYTES`].
    TooLong {
        bytes: usize,
    },
    /// Whitespace at the start or the end.
    Untrimmed,
    /// A whitespace, control, format or default-ignorable character, first at byte `at`.
    Invisible {
        at: usize,
        ch: char,
    },
}

impl std::fmt::Display for TenantFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TenantFault::Empty => f.write_str("empty"),
            TenantFault::TooLong { bytes } => {
                write!(f, "is {bytes} bytes, over {MAX_TENANT_BYTES}")
            }
            TenantFault::Untrimmed => f.write_str("has leading or trailing whitespace"),
            TenantFault::Invisible { at, ch } => write!(
                f,
                "holds U+{:04X} at byte {at}: no whitespace but the ASCII space, control, format \
                 or other invisible character",
                u32::from(*ch)
            ),
        }
    }
}

/// The characters no tenant id holds (see the module doc).
static INVISIBLE: LazyLock<regex::Regex> = LazyLock::new(|| {
    regex::Regex::new(r"[[\p{White_Space}\p{Cc}\p{Cf}\p{Default_Ignorable_Code_Point}]--[ ]]")
        .expect("a valid pattern")
});

/// `Ok` when `t` is a tenant id the hub takes, else the first fault found.
pub fn check_tenant(t: &str) -> Result<(), TenantFault> {
    if t.is_empty() {
        return Err(TenantFault::Empty);
    }
    if t.len() > MAX_TENANT_BYTES {
        return Err(TenantFault::TooLong { bytes: t.len() });
    }
    if t.trim() != t {
        return Err(TenantFault::Untrimmed);
    }
    // In ASCII the set is the control characters and DEL (a space inside is taken).
    let found = if t.is_ascii() {
        t.bytes()
            .position(|b| b < b' ' || b == 0x7f)
            .map(|at| (at, char::from(t.as_bytes()[at])))
    } else {
        INVISIBLE
            .find(t)
            .and_then(|m| Some((m.start(), m.as_str().chars().next()?)))
    };
    match found {
        Some((at, ch)) => Err(TenantFault::Invisible { at, ch }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_id_is_1_to_256_bytes_with_no_invisible_character() {
        for good in [
            "default",
            "tenant-1",
            "acme_ltda.br",
            "租户",
            "acme ltda",
            "acme ltda\u{e9}",
            "conta-çé-✓",
            &"t".repeat(MAX_TENANT_BYTES),
        ] {
            assert_eq!(check_tenant(good), Ok(()), "{good:?}");
        }
        assert_eq!(check_tenant(""), Err(TenantFault::Empty));
        assert_eq!(
            check_tenant(&"t".repeat(MAX_TENANT_BYTES + 1)),
            Err(TenantFault::TooLong { bytes: 257 })
        );
        for untrimmed in [
            " acme",
            "acme ",
            "\u{a0}acme",
            "acme\u{3000}",
            "\tacme",
            " ",
        ] {
            assert_eq!(
                check_tenant(untrimmed),
                Err(TenantFault::Untrimmed),
                "{untrimmed:?}"
            );
        }
    }

    #[test]
    fn whitespace_format_and_ignorable_characters_are_refused_inside_an_id() {
        for (id, ch) in [
            ("a\u{0}b", '\u{0}'),
            ("a\u{7f}b", '\u{7f}'),
            ("acme\u{a0}ltda", '\u{a0}'),
            ("acme\u{200b}", '\u{200b}'),
            ("acme\u{202e}1", '\u{202e}'),
            ("\u{feff}acme", '\u{feff}'),
            ("ac\u{ad}me", '\u{ad}'),
            ("ac\u{2060}me", '\u{2060}'),
            ("ac\u{2028}me", '\u{2028}'),
            ("ac\u{85}me", '\u{85}'),
            ("ac\u{34f}me", '\u{34f}'),
            ("ac\u{3164}me", '\u{3164}'),
            ("ac\u{fe0f}me", '\u{fe0f}'),
            ("ac\u{e0001}me", '\u{e0001}'),
            ("租\u{200d}户", '\u{200d}'),
        ] {
            match check_tenant(id) {
                Err(TenantFault::Invisible { ch: found, at }) => {
                    assert_eq!(found, ch, "{id:?}");
                    assert_eq!(id[at..].chars().next(), Some(ch), "{id:?}");
                }
                other => panic!("{id:?}: {other:?}"),
            }
        }
        let shown = check_tenant("acme\u{202e}1").unwrap_err().to_string();
        assert_eq!(
            shown,
            "holds U+202E at byte 4: no whitespace but the ASCII space, control, format or other \
             invisible character"
        );
    }
}
