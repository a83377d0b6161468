//! The layout of the projection's keys in its [`StateStore`](crate::state::StateStore).
//!
//! A key is a one-byte tag, then numbers of one byte, then text components. A component is its
//! UTF-8 bytes with `0x00` written `0x00 0xFF`, ended by `0x00 0x01`: components never prefix one
//! another, and keys sort as their components do. A row's *id* is its key values as text.
//!
//! | key                                   | value                          |
//! |---------------------------------------|--------------------------------|
//! | `c`                                   | the shape the state was built for |
//! | `m` table id…                         | the mirrored row (JSON object)  |
//! | `i` table index value id…             | empty: row `id` has `value` in the indexed column |
//! | `d` root-id…                          | empty: the document must be rebuilt at the end of the transaction |

use crate::state::StateError;

/// The configuration fingerprint.
pub(super) const SHAPE: &[u8] = b"c";
/// Mirrored rows.
const MIRROR: u8 = b'm';
/// Secondary index entries.
const INDEX: u8 = b'i';
/// Dirty documents.
pub(super) const DIRTY: u8 = b'd';

fn push_text(out: &mut Vec<u8>, text: &str) {
    for &b in text.as_bytes() {
        if b == 0 {
            out.extend_from_slice(&[0, 0xFF]);
        } else {
            out.push(b);
        }
    }
    out.extend_from_slice(&[0, 1]);
}

fn push_id(out: &mut Vec<u8>, id: &[String]) {
    for part in id {
        push_text(out, part);
    }
}

/// Decodes the components of `bytes` (a key after its tag and numbers).
pub(super) fn components(mut bytes: &[u8]) -> Result<Vec<String>, StateError> {
    let corrupt = || StateError("document projection: a malformed key in the state store".into());
    let mut parts = Vec::new();
    while !bytes.is_empty() {
        let mut text = Vec::new();
        loop {
            match bytes {
                [0, 1, rest @ ..] => {
                    bytes = rest;
                    break;
                }
                [0, 0xFF, rest @ ..] => {
                    text.push(0);
                    bytes = rest;
                }
                [0, ..] | [] => return Err(corrupt()),
                [b, rest @ ..] => {
                    text.push(*b);
                    bytes = rest;
                }
            }
        }
        parts.push(String::from_utf8(text).map_err(|_| corrupt())?);
    }
    Ok(parts)
}

/// Every mirrored row of `table`.
pub(super) fn mirror_prefix(table: u8) -> Vec<u8> {
    vec![MIRROR, table]
}

/// The mirrored row `id` of `table`.
pub(super) fn mirror(table: u8, id: &[String]) -> Vec<u8> {
    let mut key = mirror_prefix(table);
    push_id(&mut key, id);
    key
}

/// The rows of `table` whose indexed column `index` holds `value`.
pub(super) fn index_prefix(table: u8, index: u8, value: &str) -> Vec<u8> {
    let mut key = vec![INDEX, table, index];
    push_text(&mut key, value);
    key
}

/// The index entry of row `id`.
pub(super) fn index(table: u8, index: u8, value: &str, id: &[String]) -> Vec<u8> {
    let mut key = index_prefix(table, index, value);
    push_id(&mut key, id);
    key
}

/// The dirty mark of document `id`.
pub(super) fn dirty(id: &[String]) -> Vec<u8> {
    let mut key = vec![DIRTY];
    push_id(&mut key, id);
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_round_trip_and_never_prefix_each_other() {
        let ids: Vec<Vec<String>> = vec![
            vec!["a".into()],
            vec!["a".into(), "b".into()],
            vec!["ab".into()],
            vec!["a\0b".into(), String::new()],
            vec![String::new()],
        ];
        for id in &ids {
            let key = mirror(3, id);
            assert_eq!(&components(&key[2..]).unwrap(), id);
            for other in ids.iter().filter(|o| *o != id) {
                let prefix = index_prefix(1, 2, &id[0]);
                let entry = index(1, 2, &other[0], other);
                assert!(
                    other[0] == id[0] || !entry.starts_with(&prefix),
                    "{id:?} {other:?}"
                );
            }
        }
        assert!(dirty(&["a".into()]) < dirty(&["a".into(), "b".into()]));
        assert!(dirty(&["a".into(), "b".into()]) < dirty(&["ab".into()]));
        assert!(components(&[b'x', 0]).is_err());
    }
}
