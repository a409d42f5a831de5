//! Text written to Postgres, made safe in one place: a `text` column refuses a NUL byte
//! (SQLSTATE 22021), and an error message can be any size. Every free text dedup writes (a
//! failure, a parked message's last error, a dead letter's reason) goes through [`safe_text`], so
//! that recording a failure can never fail because of what the failure says: no NUL, and at most
//! 4 KiB.

use std::borrow::Cow;

/// The most bytes of free text kept; the rest is cut (at a character boundary) and said so.
pub const MAX_TEXT_BYTES: usize = 4096;

/// `s` as Postgres can store it: each NUL as U+FFFD, at most [`MAX_TEXT_BYTES`] bytes (a longer
/// text is cut at a character boundary and ends with how long it was).
pub fn safe_text(s: &str) -> Cow<'_, str> {
    if s.len() <= MAX_TEXT_BYTES && !s.contains('\0') {
        return Cow::Borrowed(s);
    }
    let mut t = s.replace('\0', "\u{FFFD}");
    if t.len() > MAX_TEXT_BYTES {
        let note = format!(" … (cut: {} bytes in all)", s.len());
        let mut cut = MAX_TEXT_BYTES - note.len();
        while !t.is_char_boundary(cut) {
            cut -= 1;
        }
        t.truncate(cut);
        t.push_str(&note);
    }
    Cow::Owned(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_borrowed_as_it_is() {
        assert!(matches!(
            safe_text("ledger down"),
            Cow::Borrowed("ledger down")
        ));
    }

    #[test]
    fn a_nul_becomes_a_replacement_character() {
        assert_eq!(safe_text("bad\0payload"), "bad\u{FFFD}payload");
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary_and_says_so() {
        let long = "é".repeat(MAX_TEXT_BYTES);
        let safe = safe_text(&long);
        assert!(safe.len() <= MAX_TEXT_BYTES, "{}", safe.len());
        assert!(safe.ends_with(&format!("(cut: {} bytes in all)", long.len())));
        assert!(safe.starts_with("éé"));
    }
}
