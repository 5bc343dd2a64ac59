//! The history's on-disk format: segment files of framed records. A segment starts with
//! `MAGIC`; each record is its length (u32, little endian), the CRC-32 of its bytes (u32, little
//! endian) and the bytes (one JSON document). A crash can leave a segment's last record half
//! written, and a disk can hand back garbage: a reader stops at the first frame whose length is
//! impossible or whose checksum does not match, keeps what came before and says where it stopped.
//! The writer never appends to a segment it did not start (a new run starts a new segment), so
//! damage stays where it happened.

use std::io::{self, Read, Write};

/// The first bytes of every segment (the format's version is in it).
pub const MAGIC: &[u8] = b"GPUGUARD-HISTORY-1\n";
/// No record is larger than this (a status report of a busy host is a few hundred KiB).
pub const MAX_RECORD: usize = 16 << 20;

/// Writes one framed record.
pub fn write_record(out: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    if bytes.len() > MAX_RECORD {
        return Err(io::Error::other(format!(
            "a record of {} bytes is over the limit of {MAX_RECORD}",
            bytes.len()
        )));
    }
    let mut frame = Vec::with_capacity(8 + bytes.len());
    frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    frame.extend_from_slice(&crc32fast::hash(bytes).to_le_bytes());
    frame.extend_from_slice(bytes);
    // One write per record: a crash leaves at most this one torn.
    out.write_all(&frame)
}

/// What a segment held: its records' bytes, in order, and where reading stopped early, if it did.
#[derive(Debug, Default)]
pub struct Segment {
    pub records: Vec<Vec<u8>>,
    /// "at byte N: why" where the segment is damaged (the rest of it is not read).
    pub damage: Option<String>,
}

/// Reads a whole segment.
pub fn read_segment(input: &mut impl Read) -> io::Result<Segment> {
    let mut all = Vec::new();
    input.read_to_end(&mut all)?;
    let mut out = Segment::default();
    if !all.starts_with(MAGIC) {
        out.damage = Some("at byte 0: not a gpuguard history segment".into());
        return Ok(out);
    }
    let mut at = MAGIC.len();
    while at < all.len() {
        let rest = &all[at..];
        if rest.len() < 8 {
            out.damage = Some(format!(
                "at byte {at}: a record cut short (a crash while writing)"
            ));
            break;
        }
        let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(rest[4..8].try_into().unwrap());
        if len > MAX_RECORD {
            out.damage = Some(format!("at byte {at}: impossible record length {len}"));
            break;
        }
        if rest.len() < 8 + len {
            out.damage = Some(format!(
                "at byte {at}: a record cut short (a crash while writing)"
            ));
            break;
        }
        let bytes = &rest[8..8 + len];
        if crc32fast::hash(bytes) != crc {
            out.damage = Some(format!("at byte {at}: checksum mismatch"));
            break;
        }
        out.records.push(bytes.to_vec());
        at += 8 + len;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(records: &[&[u8]]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        for r in records {
            write_record(&mut out, r).unwrap();
        }
        out
    }

    #[test]
    fn records_come_back_as_written() {
        let bytes = segment(&[b"{\"a\":1}", b"", b"{\"b\":2}"]);
        let read = read_segment(&mut bytes.as_slice()).unwrap();
        assert_eq!(
            read.records,
            [b"{\"a\":1}".to_vec(), vec![], b"{\"b\":2}".to_vec()]
        );
        assert_eq!(read.damage, None);
    }

    #[test]
    fn a_torn_last_record_is_left_out_and_said() {
        let whole = segment(&[b"first", b"second record"]);
        // Every cut inside the second record's frame keeps the first one only.
        let second_starts = MAGIC.len() + 8 + 5;
        for cut in second_starts + 1..whole.len() {
            let read = read_segment(&mut &whole[..cut]).unwrap();
            assert_eq!(read.records, [b"first".to_vec()], "cut at {cut}");
            let damage = read.damage.unwrap();
            assert!(
                damage.starts_with(&format!("at byte {second_starts}")),
                "{damage}"
            );
        }
    }

    #[test]
    fn garbage_appended_or_flipped_stops_the_reading_there() {
        let mut bytes = segment(&[b"first", b"second"]);
        let good = bytes.len();
        bytes.extend_from_slice(b"\xff\xff\xff\x7fgarbage that is not a frame");
        let read = read_segment(&mut bytes.as_slice()).unwrap();
        assert_eq!(read.records.len(), 2);
        assert!(read
            .damage
            .unwrap()
            .starts_with(&format!("at byte {good}: impossible")));
        // A flipped bit in the second record: its checksum no longer matches.
        let mut flipped = segment(&[b"first", b"second"]);
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        let read = read_segment(&mut flipped.as_slice()).unwrap();
        assert_eq!(read.records, [b"first".to_vec()]);
        assert!(read.damage.unwrap().contains("checksum mismatch"));
        // Not a segment at all.
        let read = read_segment(&mut &b"hello"[..]).unwrap();
        assert!(read.records.is_empty());
        assert!(read.damage.is_some());
    }
}
