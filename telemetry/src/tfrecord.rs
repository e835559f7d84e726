//! TFRecord framing, the container of TensorBoard's event files: each record is
//!
//! ```text
//! u64 length (little endian) | u32 masked CRC-32C of those 8 bytes | data | u32 masked CRC-32C of data
//! ```
//!
//! The CRC is Castagnoli's (CRC-32C), "masked" as TensorFlow's `crc32c::Mask` does so that a CRC
//! of data that itself holds CRCs is not degenerate: rotate right by 15 bits, add a constant.

use anyhow::{bail, Context, Result};
use std::io::Write;

const MASK_DELTA: u32 = 0xa282_ead8;

/// TensorFlow's `crc32c::Mask`.
pub fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// TensorFlow's `crc32c::Unmask`, the inverse of [`mask`].
pub fn unmask(masked: u32) -> u32 {
    masked.wrapping_sub(MASK_DELTA).rotate_left(15)
}

pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    mask(crc32c::crc32c(bytes))
}

/// One framed record, ready to be written with a single `write` (so a crash tears at most the
/// last record, which [`read_records`] then reports as incomplete).
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

pub fn write_record(out: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    out.write_all(&frame(data))
}

/// The records of a TFRecord file's bytes, both checksums verified. A last record cut short (an
/// interrupted write) is dropped and counted in `torn_tail`; a checksum that does not match is
/// an error: the file is damaged, not merely unfinished.
#[derive(Debug)]
pub struct Records {
    pub records: Vec<Vec<u8>>,
    pub torn_tail: bool,
}

pub fn read_records(bytes: &[u8]) -> Result<Records> {
    let mut records = Vec::new();
    let mut at = 0usize;
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    while at < bytes.len() {
        let rest = bytes.len() - at;
        if rest < 12 {
            return Ok(Records { records, torn_tail: true });
        }
        let len_bytes = &bytes[at..at + 8];
        if masked_crc32c(len_bytes) != u32_at(at + 8) {
            bail!("record at byte {at}: the length's checksum does not match (the file is damaged)");
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        // The whole record is here: its length, the data and the data's checksum.
        match usize::try_from(len).ok().filter(|&l| l.saturating_add(16) <= rest) {
            Some(len) => {
                let data = &bytes[at + 12..at + 12 + len];
                if masked_crc32c(data) != u32_at(at + 12 + len) {
                    bail!("record at byte {at}: the data's checksum does not match (the file is damaged)");
                }
                records.push(data.to_vec());
                at += 16 + len;
            }
            None => return Ok(Records { records, torn_tail: true }),
        }
    }
    Ok(Records { records, torn_tail: false })
}

pub fn read_file(path: &std::path::Path) -> Result<Records> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    read_records(&bytes).with_context(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C's check value and RFC 3720's (iSCSI) test vectors, which TensorFlow's
    /// `crc32c_test.cc` checks its implementation against.
    #[test]
    fn crc32c_matches_the_published_test_vectors() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c::crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c::crc32c(&ascending), 0x46dd_794e);
        let descending: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c::crc32c(&descending), 0x113f_db5c);
    }

    /// TensorFlow's `CRC.Mask` test: masking changes the CRC, twice too, and unmasking undoes it.
    #[test]
    fn mask_is_tensorflows_and_unmask_inverts_it() {
        let crc = crc32c::crc32c(b"foo");
        assert_ne!(crc, mask(crc));
        assert_ne!(crc, mask(mask(crc)));
        assert_eq!(crc, unmask(mask(crc)));
        assert_eq!(crc, unmask(unmask(mask(mask(crc)))));
        // The definition, spelled out: rotate right by 15, add 0xa282ead8.
        assert_eq!(mask(1), (1u32 << 17).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn framed_records_read_back_and_damage_is_caught() {
        let mut file = Vec::new();
        for data in [&b"first"[..], b"", b"the third record"] {
            write_record(&mut file, data).unwrap();
        }
        let read = read_records(&file).unwrap();
        assert_eq!(read.records, vec![b"first".to_vec(), vec![], b"the third record".to_vec()]);
        assert!(!read.torn_tail);
        // The layout: 8-byte length, its masked CRC, the data, the data's masked CRC.
        assert_eq!(&file[..8], &5u64.to_le_bytes());
        assert_eq!(&file[8..12], &masked_crc32c(&5u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&file[12..17], b"first");
        assert_eq!(&file[17..21], &masked_crc32c(b"first").to_le_bytes());

        // Cut anywhere inside the last record: the first two records and a torn tail.
        for cut in [file.len() - 1, file.len() - 10, 21 + 16 + 3] {
            let read = read_records(&file[..cut]).unwrap();
            assert_eq!(read.records.len(), 2, "cut at {cut}");
            assert!(read.torn_tail);
        }
        // A flipped bit in a record's data or length is an error naming the record.
        let mut bad = file.clone();
        bad[14] ^= 1;
        assert!(read_records(&bad).unwrap_err().to_string().contains("data's checksum"));
        let mut bad = file.clone();
        bad[21] ^= 1;
        assert!(read_records(&bad).unwrap_err().to_string().contains("record at byte 21"));
    }

    #[test]
    fn a_tail_of_a_length_and_its_checksum_alone_is_torn_or_damaged_by_its_checksum() {
        let mut file = frame(b"one");
        let next = frame(b"two");
        // 12 bytes of the next record: its length and the length's checksum, no data yet.
        file.extend_from_slice(&next[..12]);
        let read = read_records(&file).unwrap();
        assert_eq!((read.records, read.torn_tail), (vec![b"one".to_vec()], true));
        // The same 12 bytes with a wrong checksum were never a record's beginning: damage.
        let at = file.len() - 12;
        file[at] ^= 1;
        let err = read_records(&file).unwrap_err().to_string();
        assert!(err.contains(&format!("record at byte {at}: the length's checksum")), "{err}");
    }

    #[test]
    fn a_length_past_any_file_is_a_torn_tail_not_an_overflow() {
        for len in [u64::MAX, u64::MAX - 15, 1 << 40] {
            let mut file = frame(b"one");
            file.extend_from_slice(&len.to_le_bytes());
            file.extend_from_slice(&masked_crc32c(&len.to_le_bytes()).to_le_bytes());
            file.extend_from_slice(b"some bytes");
            let read = read_records(&file).unwrap();
            assert_eq!((read.records, read.torn_tail), (vec![b"one".to_vec()], true), "length {len}");
        }
    }
}
