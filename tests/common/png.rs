//! Just enough of a PNG reader to tell a screenshot from a blank page: the image's size and how
//! many distinct colours its pixels hold (8-bit RGB or RGBA, not interlaced: what Chromium
//! writes).

use std::collections::HashSet;

/// Width, height and the number of distinct colours of the PNG `bytes`.
pub fn colours(bytes: &[u8]) -> (u32, u32, usize) {
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "not a PNG (no signature)"
    );
    let mut at = 8;
    let (mut width, mut height, mut channels) = (0u32, 0u32, 0usize);
    let mut data = Vec::new();
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let kind = &bytes[at + 4..at + 8];
        let body = &bytes[at + 8..at + 8 + len];
        match kind {
            b"IHDR" => {
                width = u32::from_be_bytes(body[0..4].try_into().unwrap());
                height = u32::from_be_bytes(body[4..8].try_into().unwrap());
                assert_eq!(body[8], 8, "8-bit samples");
                assert_eq!(body[12], 0, "not interlaced");
                channels = match body[9] {
                    2 => 3,
                    6 => 4,
                    other => panic!("colour type {other} not read here"),
                };
            }
            b"IDAT" => data.extend_from_slice(body),
            b"IEND" => break,
            _ => {}
        }
        at += 12 + len;
    }
    let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&data).expect("IDAT inflates");
    let stride = width as usize * channels;
    let mut previous = vec![0u8; stride];
    let mut seen = HashSet::new();
    for row in raw.chunks(stride + 1).take(height as usize) {
        let (filter, line) = (row[0], &row[1..]);
        let mut current = vec![0u8; stride];
        for i in 0..stride {
            let left = if i >= channels {
                current[i - channels]
            } else {
                0
            };
            let up = previous[i];
            let up_left = if i >= channels {
                previous[i - channels]
            } else {
                0
            };
            let predicted = match filter {
                0 => 0,
                1 => left,
                2 => up,
                3 => ((u16::from(left) + u16::from(up)) / 2) as u8,
                4 => paeth(left, up, up_left),
                other => panic!("PNG filter {other}"),
            };
            current[i] = line[i].wrapping_add(predicted);
        }
        for pixel in current.chunks(channels) {
            seen.insert(pixel[..3].to_vec());
        }
        previous = current;
    }
    (width, height, seen.len())
}

fn paeth(a: u8, b: u8, c: u8) -> u8 {
    let p = i16::from(a) + i16::from(b) - i16::from(c);
    let (pa, pb, pc) = (
        (p - i16::from(a)).abs(),
        (p - i16::from(b)).abs(),
        (p - i16::from(c)).abs(),
    );
    if pa <= pb && pa <= pc {
        a
    } else if pb <= pc {
        b
    } else {
        c
    }
}
