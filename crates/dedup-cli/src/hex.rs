//! Keys as hex on the command line: how a key that is not printable text is shown (`hex:...`)
//! and given back (`--hex-key`), without loss.

/// Hex digits (either case; an optional `hex:` or `0x` before them) as bytes.
pub(crate) fn parse(s: &str) -> Result<Vec<u8>, String> {
    let digits = ["hex:", "0x", "0X"]
        .iter()
        .find_map(|p| s.strip_prefix(p))
        .unwrap_or(s);
    if digits.is_empty() || !digits.len().is_multiple_of(2) {
        return Err("an even, non-zero number of hex digits".into());
    }
    let value = |c: u8| -> Result<u8, String> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("{:?} is not a hex digit", char::from(c))),
        }
    };
    digits
        .as_bytes()
        .chunks(2)
        .map(|p| -> Result<u8, String> { Ok((value(p[0])? << 4) | value(p[1])?) })
        .collect()
}

/// `bytes` as `hex:` and lower-case digits.
pub(crate) fn shown(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(4 + bytes.len() * 2);
    out.push_str("hex:");
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_keys_read_and_print() {
        assert_eq!(parse("00ff10"), Ok(vec![0, 255, 16]));
        assert_eq!(parse("0xAbCd"), Ok(vec![0xab, 0xcd]));
        assert_eq!(parse("hex:0aff"), Ok(vec![10, 255]));
        assert!(parse("abc").is_err());
        assert!(parse("zz").is_err());
        assert!(parse("").is_err());
        assert_eq!(shown(&[0xff, 0x00]), "hex:ff00");
        assert_eq!(parse(&shown(&[1, 2, 254])), Ok(vec![1, 2, 254]));
    }
}
