//! Which rows survive a compaction, chosen with bounded memory.
//!
//! The merge's first pass hands every change row (and every row of the previous state) to
//! [`Partitions`] as a [`Record`]: the hashes of its key and group, its position, its op and
//! where it is (input and row). Records are split by the hash of what decides among them (the
//! key, or the group in an exploded table) into as many partitions as it takes to keep about
//! `partition_rows` records in each: one partition stays in memory, more are spill files.
//! [`Partitions::choose`] then reads one partition at a time and picks its survivors, which
//! depend only on rows of the same key or group, so on that partition alone (and on the newest
//! truncate, counted while partitioning): per key the newest position, unless a delete; in an
//! exploded table every row of a group at the group's newest position. Each partition's
//! survivors, as `(input, row)` sorted, go to a file of their own; [`SurvivorRows`] reads the
//! files merged back into one ascending sequence, which the second pass follows input by input.
//!
//! Memory: one partition's records (64 bytes each) and its hash map (about 40 bytes a key) at a
//! time, and a buffer per spill file. That does not grow with the table up to
//! [`MAX_PARTITIONS`] partitions (134M rows); past it, partitions grow. A key (or group) is never
//! split, so one changed a million times in the merged interval brings a million records into
//! its partition.

use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};

/// Records held in memory at once when choosing survivors: about 55 MiB (64 bytes a record and
/// the hash map's 40 a key), small next to the decoded batches, and few enough spill files (ten
/// for 5M rows) that following them back costs little.
pub(super) const PARTITION_ROWS: usize = 512 * 1024;

/// Spill files open at once, each with its buffer (16 MiB in all), well below the usual limit of
/// 1,024 open files: partitions hold more than [`PARTITION_ROWS`] only past 134M rows.
const MAX_PARTITIONS: usize = 256;

/// Buffer of each spill file (written and read sequentially).
const SPILL_BUFFER_BYTES: usize = 64 * 1024;

/// One row of an input, as far as choosing survivors goes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Record {
    /// Hash of the key columns, or of the group columns in an exploded table.
    pub by: u128,
    /// Hash of the key columns in an exploded table (0 otherwise).
    pub full: u128,
    pub position: u128,
    /// `u` or `d`.
    pub op: u8,
    pub input: u32,
    pub row: u32,
}

/// A record as stored in a spill file.
const RECORD_BYTES: usize = 16 * 3 + 1 + 4 + 4;

impl Record {
    fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut out = [0u8; RECORD_BYTES];
        out[0..16].copy_from_slice(&self.by.to_le_bytes());
        out[16..32].copy_from_slice(&self.full.to_le_bytes());
        out[32..48].copy_from_slice(&self.position.to_le_bytes());
        out[48] = self.op;
        out[49..53].copy_from_slice(&self.input.to_le_bytes());
        out[53..57].copy_from_slice(&self.row.to_le_bytes());
        out
    }

    fn decode(b: &[u8; RECORD_BYTES]) -> Self {
        let u128_at = |i: usize| u128::from_le_bytes(b[i..i + 16].try_into().expect("16 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Self {
            by: u128_at(0),
            full: u128_at(16),
            position: u128_at(32),
            op: b[48],
            input: u32_at(49),
            row: u32_at(53),
        }
    }
}

fn io_error(what: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("cannot {what} a compaction spill file: {e}")
}

/// Records split by key hash: in memory when they fit one partition, else in spill files.
pub(super) struct Partitions {
    dir: std::path::PathBuf,
    memory: Vec<Record>,
    files: Vec<BufWriter<File>>,
    /// The newest truncate seen.
    truncated: u128,
}

/// What [`Partitions::choose`] found.
pub(super) struct Chosen {
    /// Survivors per input.
    pub counts: Vec<usize>,
    pub rows: SurvivorRows,
    /// Partitions the records were split into.
    pub partitions: usize,
    /// The most records held in memory at once.
    pub peak_records: usize,
}

impl Partitions {
    /// Partitions for `rows` records of about `partition_rows` each, spilled under `dir`.
    pub fn new(rows: usize, partition_rows: usize, dir: &std::path::Path) -> Result<Self, String> {
        let count = rows
            .div_ceil(partition_rows.max(1))
            .clamp(1, MAX_PARTITIONS);
        let files = if count == 1 {
            Vec::new()
        } else {
            (0..count)
                .map(|p| {
                    File::create(dir.join(format!("records-{p}")))
                        .map(|f| BufWriter::with_capacity(SPILL_BUFFER_BYTES, f))
                        .map_err(io_error("create"))
                })
                .collect::<Result<_, _>>()?
        };
        Ok(Self {
            dir: dir.to_owned(),
            memory: Vec::new(),
            files,
            truncated: 0,
        })
    }

    pub fn truncate(&mut self, position: u128) {
        self.truncated = self.truncated.max(position);
    }

    /// Adds a record; records are added in input order, and in row order within an input (ties
    /// go to the first).
    pub fn push(&mut self, record: Record) -> Result<(), String> {
        if self.files.is_empty() {
            self.memory.push(record);
            return Ok(());
        }
        let p = (partition_hash(record.by) % self.files.len() as u64) as usize;
        self.files[p]
            .write_all(&record.encode())
            .map_err(io_error("write"))
    }

    /// Picks the survivors of each partition in turn.
    pub fn choose(self, grouped: bool, inputs: usize) -> Result<Chosen, String> {
        let mut counts = vec![0usize; inputs];
        let partitions = self.files.len().max(1);
        if self.files.is_empty() {
            let picked = survivors(&self.memory, grouped, self.truncated);
            for &p in &picked {
                counts[(p >> 32) as usize] += 1;
            }
            return Ok(Chosen {
                counts,
                rows: SurvivorRows::new(vec![Source::Memory(picked.into_iter())])?,
                partitions,
                peak_records: self.memory.len(),
            });
        }
        let mut sources = Vec::with_capacity(partitions);
        let mut peak_records = 0;
        for (p, file) in self.files.into_iter().enumerate() {
            // Flushed and closed before it is read back.
            file.into_inner()
                .map_err(|e| io_error("write")(e.into_error()))?;
            let records = read_records(&self.dir.join(format!("records-{p}")))?;
            peak_records = peak_records.max(records.len());
            let picked = survivors(&records, grouped, self.truncated);
            drop(records);
            let path = self.dir.join(format!("survivors-{p}"));
            let mut out = BufWriter::with_capacity(
                SPILL_BUFFER_BYTES,
                File::create(&path).map_err(io_error("create"))?,
            );
            for &r in &picked {
                counts[(r >> 32) as usize] += 1;
                out.write_all(&r.to_le_bytes()).map_err(io_error("write"))?;
            }
            out.flush().map_err(io_error("write"))?;
            std::fs::remove_file(self.dir.join(format!("records-{p}")))
                .map_err(io_error("remove"))?;
            let reader = File::open(&path).map_err(io_error("open"))?;
            sources.push(Source::File(BufReader::with_capacity(
                SPILL_BUFFER_BYTES,
                reader,
            )));
        }
        Ok(Chosen {
            counts,
            rows: SurvivorRows::new(sources)?,
            partitions,
            peak_records,
        })
    }
}

/// Which partition a key hash goes to: its high half (the hash map of a partition uses the low
/// one), mixed (murmur3's finalizer), since the high bits of FNV-1a carry a key's last bytes only
/// into a few of them, which left partitions twice as full as others.
fn partition_hash(by: u128) -> u64 {
    let mut x = (by >> 64) as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn read_records(path: &std::path::Path) -> Result<Vec<Record>, String> {
    let file = File::open(path).map_err(io_error("open"))?;
    let len = file.metadata().map_err(io_error("read"))?.len() as usize;
    let mut reader = BufReader::with_capacity(SPILL_BUFFER_BYTES, file);
    let mut records = Vec::with_capacity(len / RECORD_BYTES);
    let mut buf = [0u8; RECORD_BYTES];
    for _ in 0..len / RECORD_BYTES {
        reader.read_exact(&mut buf).map_err(io_error("read"))?;
        records.push(Record::decode(&buf));
    }
    Ok(records)
}

/// The survivors among `records` (all the rows of their keys or groups), as `input << 32 | row`
/// ascending: per key (or, in an exploded table, per group) the row with the newest position,
/// unless it is a delete or at or before the newest truncate.
fn survivors(records: &[Record], grouped: bool, truncated: u128) -> Vec<u64> {
    let mut winners: PrehashedMap<u32> = PrehashedMap::default();
    for (j, r) in records.iter().enumerate() {
        match winners.get_mut(&r.by) {
            Some(w) => {
                if records[*w as usize].position < r.position {
                    *w = j as u32;
                }
            }
            None => {
                winners.insert(r.by, j as u32);
            }
        }
    }
    let at = |r: &Record| (u64::from(r.input) << 32) | u64::from(r.row);
    let mut picked: Vec<u64> = if grouped {
        // Every upsert row of a group at the group's newest position, each key once (a replayed
        // file may hold the same change twice).
        let mut seen: HashSet<u128, std::hash::BuildHasherDefault<Prehashed>> = HashSet::default();
        records
            .iter()
            .filter(|r| {
                let winner = &records[winners[&r.by] as usize];
                r.op == b'u'
                    && r.position == winner.position
                    && r.position > truncated
                    && winner.op == b'u'
                    && seen.insert(r.full)
            })
            .map(at)
            .collect()
    } else {
        winners
            .into_values()
            .map(|w| &records[w as usize])
            .filter(|r| r.op == b'u' && r.position > truncated)
            .map(at)
            .collect()
    };
    picked.sort_unstable();
    picked
}

/// A sorted sequence of survivors.
enum Source {
    Memory(std::vec::IntoIter<u64>),
    File(BufReader<File>),
}

impl Source {
    fn next(&mut self) -> Result<Option<u64>, String> {
        match self {
            Self::Memory(rows) => Ok(rows.next()),
            Self::File(reader) => {
                let mut buf = [0u8; 8];
                match reader.read_exact(&mut buf) {
                    Ok(()) => Ok(Some(u64::from_le_bytes(buf))),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
                    Err(e) => Err(io_error("read")(e)),
                }
            }
        }
    }
}

/// The survivors of every partition merged in `(input, row)` order.
pub(super) struct SurvivorRows {
    sources: Vec<Source>,
    /// The next survivor of each source not yet taken, smallest first.
    heads: BinaryHeap<std::cmp::Reverse<(u64, usize)>>,
}

impl SurvivorRows {
    fn new(mut sources: Vec<Source>) -> Result<Self, String> {
        let mut heads = BinaryHeap::with_capacity(sources.len());
        for (i, s) in sources.iter_mut().enumerate() {
            if let Some(r) = s.next()? {
                heads.push(std::cmp::Reverse((r, i)));
            }
        }
        Ok(Self { sources, heads })
    }

    /// The next survivor's row in its input (the caller knows how many each input has).
    pub fn next_row(&mut self) -> Result<u32, String> {
        let std::cmp::Reverse((r, i)) = self
            .heads
            .pop()
            .ok_or("fewer surviving rows than counted")?;
        if let Some(next) = self.sources[i].next()? {
            self.heads.push(std::cmp::Reverse((next, i)));
        }
        Ok(r as u32)
    }

    /// Passes over `count` survivors.
    pub fn skip(&mut self, count: usize) -> Result<(), String> {
        for _ in 0..count {
            self.next_row()?;
        }
        Ok(())
    }
}

/// Hashes `u128` keys that are hashes already: their low bits are the hash.
#[derive(Default)]
pub(super) struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

type PrehashedMap<V> = HashMap<u128, V, std::hash::BuildHasherDefault<Prehashed>>;
