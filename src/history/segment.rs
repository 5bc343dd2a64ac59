//! The history's on-disk format: segment files of framed records. A segment starts with
//! `MAGIC`; each record is its length (u32, little endian), the CRC-32 of its bytes (u32, little
//! endian) and the bytes (one JSON document). A crash can leave a segment's last record half
//! written, and a disk can hand back garbage: a reader stops at the first frame whose length is
//! impossible or whose checksum does not match, keeps what came before and says where it stopped.
//! The writer never appends to a segment it did not start (a new run starts a new segment), so
//! damage stays where it happened. Reading streams: one record in memory at a time, and nothing
//! past a first line that is not `MAGIC`; no segment is larger than `MAX_SEGMENT`.

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

/// No segment is larger than this: the writer rolls at a sixteenth of `[history] max_size` but
/// at most here (and a record alone in its segment is at most `MAX_RECORD`). Readers refuse a
/// larger file unread: `--dir` may name a directory anyone wrote, with a sparse terabyte in it.
pub const MAX_SEGMENT: u64 = 64 << 20;
const _: () = assert!(MAX_SEGMENT >= (MAGIC.len() + 8 + MAX_RECORD) as u64);

/// Reads a segment one record at a time (at most one record in memory), handing each record's
/// bytes and where it starts to `each`. Returns where reading stopped early, if it did ("at
/// byte N: why"): a first line that is not `MAGIC` (nothing else is read), a length that is
/// impossible, a record cut short, a checksum that does not match.
pub fn read_segment(
    input: &mut impl Read,
    mut each: impl FnMut(&[u8], u64),
) -> io::Result<Option<String>> {
    let mut magic = [0u8; MAGIC.len()];
    if fill(input, &mut magic)? < MAGIC.len() || magic != MAGIC {
        return Ok(Some("at byte 0: not a gpuguard history segment".into()));
    }
    let mut at = MAGIC.len() as u64;
    let mut bytes = Vec::new();
    loop {
        let mut header = [0u8; 8];
        match fill(input, &mut header)? {
            0 => return Ok(None),
            8 => {}
            _ => return Ok(Some(cut_short(at))),
        }
        let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(header[4..].try_into().unwrap());
        if len > MAX_RECORD {
            return Ok(Some(format!(
                "at byte {at}: impossible record length {len}"
            )));
        }
        bytes.clear();
        // Grows with what is there, not with what the length claims.
        input.take(len as u64).read_to_end(&mut bytes)?;
        if bytes.len() < len {
            return Ok(Some(cut_short(at)));
        }
        if crc32fast::hash(&bytes) != crc {
            return Ok(Some(format!("at byte {at}: checksum mismatch")));
        }
        each(&bytes, at);
        at += 8 + len as u64;
    }
}

fn cut_short(at: u64) -> String {
    format!("at byte {at}: a record cut short (a crash while writing)")
}

/// Reads into `buf` until it is full or the input ends; how many bytes it holds.
fn fill(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
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

    /// What a segment held: its records' bytes, in order, and where reading stopped early.
    struct Segment {
        records: Vec<Vec<u8>>,
        damage: Option<String>,
    }

    fn read_all(mut input: &[u8]) -> Segment {
        let mut records = Vec::new();
        let damage = read_segment(&mut input, |bytes, _| records.push(bytes.to_vec())).unwrap();
        Segment { records, damage }
    }

    /// Nothing past the first line is read of what is not a segment: an endless input (a link
    /// to /dev/zero, a FIFO) is no hang and no memory.
    #[test]
    fn reading_stops_at_a_first_line_that_is_not_the_magic() {
        let damage = read_segment(&mut std::io::repeat(b'x'), |_, _| panic!("a record")).unwrap();
        assert_eq!(
            damage.as_deref(),
            Some("at byte 0: not a gpuguard history segment")
        );
    }

    #[test]
    fn records_come_back_as_written() {
        let bytes = segment(&[b"{\"a\":1}", b"", b"{\"b\":2}"]);
        let read = read_all(&bytes);
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
            let read = read_all(&whole[..cut]);
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
        let read = read_all(&bytes);
        assert_eq!(read.records.len(), 2);
        assert!(read
            .damage
            .unwrap()
            .starts_with(&format!("at byte {good}: impossible")));
        // A flipped bit in the second record: its checksum no longer matches.
        let mut flipped = segment(&[b"first", b"second"]);
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        let read = read_all(&flipped);
        assert_eq!(read.records, [b"first".to_vec()]);
        assert!(read.damage.unwrap().contains("checksum mismatch"));
        // Not a segment at all.
        let read = read_all(b"hello");
        assert!(read.records.is_empty());
        assert!(read.damage.is_some());
    }
}
