//! The merge of a compaction: the previous current state and the change-log rows past it, into
//! the new current state.
//!
//! Two passes over the inputs. The first decodes only the columns that decide which rows
//! survive (`_position`, `_op`, the key and group columns) and picks the survivors. The second
//! writes them, input by input:
//! - an input whose rows all survive and whose columns are exactly the output's has its column
//!   chunks copied into the new file as they are, without decoding or encoding them: every
//!   change file of an append-only load, and a previous state that no new change touches;
//! - any other input is decoded, its surviving rows are gathered, and they are encoded anew.
//!
//! Memory: every input's bytes (as stored, compressed), their control columns (about 50 bytes
//! a row), one batch of decoded rows at a time, and the new file.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, new_null_array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use bytes::Bytes;
use object_store::path::Path;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::arrow_writer::{ArrowRowGroupWriterFactory, compute_leaves};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::column::writer::ColumnCloseResult;
use parquet::file::metadata::PageIndexPolicy;
use parquet::file::writer::SerializedFileWriter;

use super::compact::{READ_BATCH_ROWS, string_column};
use super::encode::{self, META_GROUP, META_KEY, META_MERGED_THROUGH, OP, POSITION};

/// A merged current state.
pub(super) struct Merged {
    pub bytes: Bytes,
    pub rows: usize,
    /// The newest position merged.
    pub through: String,
    /// Row groups copied as they were.
    pub copied: usize,
}

/// One input: the previous current state (no `_op`: every row is live) or a change-log file.
struct Input {
    path: Path,
    bytes: Bytes,
    meta: ArrowReaderMetadata,
    previous: bool,
}

/// What the first pass keeps of an input's rows.
#[derive(Default)]
struct Control {
    position: Vec<u128>,
    /// `u`, `d` or `t`; 0 for a row merged before (at or before the previous `merged_through`).
    op: Vec<u8>,
    /// Hash of the key columns, or of the group columns in an exploded table.
    by: Vec<u128>,
    /// Hash of the key columns in an exploded table (empty otherwise).
    full: Vec<u128>,
    /// The newest position among the change-log rows merged now, as number and text.
    newest: Option<(u128, String)>,
}

fn failed(path: &Path) -> impl Fn(parquet::errors::ParquetError) -> String + '_ {
    move |e| format!("{path}: {e}")
}

impl Input {
    fn new(path: Path, bytes: Bytes, previous: bool) -> Result<Self, String> {
        // The page index comes along so that copied chunks keep theirs.
        let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
        let meta = ArrowReaderMetadata::load(&bytes, options).map_err(failed(&path))?;
        Ok(Self {
            path,
            bytes,
            meta,
            previous,
        })
    }

    fn schema(&self) -> &SchemaRef {
        self.meta.schema()
    }

    fn rows(&self) -> usize {
        self.meta.metadata().file_metadata().num_rows() as usize
    }

    /// Reads the columns in `names` that the file has (all columns when `None`), a batch of
    /// [`READ_BATCH_ROWS`] at a time.
    fn read(
        &self,
        names: Option<&[&str]>,
    ) -> Result<impl Iterator<Item = Result<RecordBatch, String>> + '_, String> {
        let mut builder = ParquetRecordBatchReaderBuilder::new_with_metadata(
            self.bytes.clone(),
            self.meta.clone(),
        )
        .with_batch_size(READ_BATCH_ROWS);
        if let Some(names) = names {
            let roots = self
                .schema()
                .fields()
                .iter()
                .enumerate()
                .filter(|(_, f)| names.contains(&f.name().as_str()))
                .map(|(i, _)| i);
            let mask = ProjectionMask::roots(self.meta.parquet_schema(), roots);
            builder = builder.with_projection(mask);
        }
        let batches = builder.build().map_err(failed(&self.path))?;
        Ok(batches.map(|batch| batch.map_err(|e| format!("{}: {e}", self.path))))
    }

    /// The first pass: positions, ops and key hashes of every row.
    fn control(
        &self,
        by: &[String],
        full: &[String],
        merged_through: &str,
    ) -> Result<Control, String> {
        let mut names: Vec<&str> = vec![POSITION, OP];
        names.extend(by.iter().chain(full).map(String::as_str));
        // Sized once: grown by doubling, the vectors of a large input would take up to twice
        // the room.
        let rows = self.rows();
        let mut control = Control {
            position: Vec::with_capacity(rows),
            op: Vec::with_capacity(rows),
            by: Vec::with_capacity(rows),
            full: Vec::with_capacity(if full.is_empty() { 0 } else { rows }),
            ..Control::default()
        };
        for batch in self.read(Some(&names))? {
            let batch = batch?;
            let positions = string_column(&batch, POSITION)?;
            let ops = if self.previous {
                None
            } else {
                Some(string_column(&batch, OP)?)
            };
            let by_columns = columns_of(&batch, by);
            let full_columns = columns_of(&batch, full);
            for r in 0..batch.num_rows() {
                let text = positions.value(r);
                let op = match ops {
                    // Rows of a file that straddles the previous merge: only those after it.
                    Some(_) if !merged_through.is_empty() && text <= merged_through => 0,
                    Some(ops) => ops.value(r).bytes().next().unwrap_or(b'u'),
                    None => b'u',
                };
                let position = position_number(text);
                if op != 0
                    && !self.previous
                    && control.newest.as_ref().is_none_or(|(n, _)| position > *n)
                {
                    control.newest = Some((position, text.to_owned()));
                }
                control.position.push(position);
                control.op.push(op);
                control.by.push(row_hash(&by_columns, r));
                if !full.is_empty() {
                    control.full.push(row_hash(&full_columns, r));
                }
            }
        }
        Ok(control)
    }

    /// Whether its column chunks can be copied into a file of `fields`: the same columns, in
    /// the same order, with the same Parquet descriptions. Returns the source column of each.
    fn copyable(
        &self,
        fields: &[Field],
        out: &SerializedFileWriter<Vec<u8>>,
    ) -> Option<Vec<usize>> {
        let own: Vec<(usize, &Arc<Field>)> = self
            .schema()
            .fields()
            .iter()
            .enumerate()
            .filter(|(_, f)| f.name() != OP)
            .collect();
        if own.len() != fields.len() {
            return None;
        }
        let source = self.meta.parquet_schema();
        let target = out.schema_descr();
        let mut columns = Vec::with_capacity(fields.len());
        for (j, ((i, f), wanted)) in own.into_iter().zip(fields).enumerate() {
            if **f != *wanted || source.column(i) != target.column(j) {
                return None;
            }
            columns.push(i);
        }
        Some(columns)
    }
}

fn columns_of(batch: &RecordBatch, names: &[String]) -> Vec<Option<ArrayRef>> {
    names
        .iter()
        .map(|k| batch.column_by_name(k).cloned())
        .collect()
}

/// Merges the previous current state with the change-log files past it (CPU work: decoding,
/// hashing keys, copying or gathering rows, encoding).
pub(super) fn merge(
    previous: Option<(Path, Bytes)>,
    changes: Vec<(Path, Bytes)>,
    merged_through: &str,
    zstd_level: i32,
    row_group_rows: usize,
) -> Result<Merged, String> {
    let mut inputs = Vec::with_capacity(changes.len() + 1);
    if let Some((path, bytes)) = previous {
        inputs.push(Input::new(path, bytes, true)?);
    }
    for (path, bytes) in changes {
        inputs.push(Input::new(path, bytes, false)?);
    }
    let mut metadata: HashMap<String, String> = HashMap::new();
    for input in &inputs {
        metadata.extend(input.schema().metadata().clone());
    }
    let names = |key: &str| -> Vec<String> {
        metadata
            .get(key)
            .map(|k| {
                k.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let key = names(META_KEY);
    let group = names(META_GROUP);
    if key.is_empty() {
        return Err("the change log does not say which columns are the key".into());
    }
    let fields = unified_fields(&inputs)?;
    let (by, full) = if group.is_empty() {
        (key.clone(), Vec::new())
    } else {
        (group.clone(), key.clone())
    };
    let controls: Vec<Control> = inputs
        .iter()
        .map(|input| input.control(&by, &full, merged_through))
        .collect::<Result<_, _>>()?;
    let picked = survivors(&controls, !group.is_empty());

    // The newest position merged: the newest change-log row past the previous merge.
    let newest = controls
        .iter()
        .filter_map(|c| c.newest.as_ref())
        .max_by_key(|(number, _)| *number)
        .map_or_else(|| merged_through.to_owned(), |(_, text)| text.clone());

    let mut out_metadata: HashMap<String, String> =
        HashMap::from([(META_KEY.to_owned(), key.join(","))]);
    if !group.is_empty() {
        out_metadata.insert(META_GROUP.to_owned(), group.join(","));
    }
    out_metadata.insert(META_MERGED_THROUGH.to_owned(), newest.clone());
    if let Some(v) = metadata.get(encode::META_SCHEMA_VERSION) {
        out_metadata.insert(encode::META_SCHEMA_VERSION.to_owned(), v.clone());
    }
    let schema: SchemaRef = Arc::new(Schema::new_with_metadata(fields.clone(), out_metadata));
    let mut out = Output::new(
        &schema,
        encode::properties(zstd_level, row_group_rows),
        row_group_rows,
    )?;
    for (input, rows) in inputs.iter().zip(&picked) {
        if rows.is_empty() {
            continue;
        }
        let copy = (rows.len() == input.rows())
            .then(|| input.copyable(&fields, &out.writer))
            .flatten();
        match copy {
            Some(columns) => out.copy(input, &columns)?,
            None => out.gather(input, rows)?,
        }
    }
    let rows = picked.iter().map(Vec::len).sum();
    let copied = out.copied;
    Ok(Merged {
        bytes: out.finish()?,
        rows,
        through: newest,
        copied,
    })
}

/// Every data column ever written, with its (non-null) type, in first-seen order.
fn unified_fields(inputs: &[Input]) -> Result<Vec<Field>, String> {
    let mut fields: Vec<Field> = Vec::new();
    for input in inputs {
        for f in input.schema().fields() {
            if f.name() == OP {
                continue;
            }
            match fields.iter_mut().find(|x| x.name() == f.name()) {
                Some(x) if *x.data_type() == DataType::Null => *x = f.as_ref().clone(),
                Some(x) if *f.data_type() != DataType::Null && x.data_type() != f.data_type() => {
                    // A declared type changed in the pipeline file, or types were learned anew
                    // after the state was deleted: merging would silently null one of them.
                    return Err(format!(
                        "column `{}` is {} in some change-log files and {} in others; \
                         rewrite or remove the older files (or the current state) before compacting",
                        f.name(),
                        x.data_type(),
                        f.data_type()
                    ));
                }
                Some(_) => {}
                None => fields.push(f.as_ref().clone()),
            }
        }
    }
    Ok(fields)
}

/// The surviving rows of each input, ascending: per key (or, in an exploded table, per group)
/// the row with the newest position, unless it is a delete or older than a truncate.
fn survivors(controls: &[Control], grouped: bool) -> Vec<Vec<u32>> {
    let mut winners: PrehashedMap<(u32, u32)> = PrehashedMap::default();
    let mut truncated = 0u128;
    for (i, c) in controls.iter().enumerate() {
        for r in 0..c.op.len() {
            let position = c.position[r];
            match c.op[r] {
                0 => continue,
                b't' => {
                    truncated = truncated.max(position);
                    continue;
                }
                _ => {}
            }
            match winners.get_mut(&c.by[r]) {
                Some((wi, wr)) => {
                    if controls[*wi as usize].position[*wr as usize] < position {
                        (*wi, *wr) = (i as u32, r as u32);
                    }
                }
                None => {
                    winners.insert(c.by[r], (i as u32, r as u32));
                }
            }
        }
    }
    let upsert = |i: usize, r: usize| controls[i].op[r] == b'u';
    let mut picked: Vec<Vec<u32>> = vec![Vec::new(); controls.len()];
    if !grouped {
        for (i, r) in winners.into_values() {
            let (i, r) = (i as usize, r as usize);
            if upsert(i, r) && controls[i].position[r] > truncated {
                picked[i].push(r as u32);
            }
        }
        for rows in &mut picked {
            rows.sort_unstable();
        }
        return picked;
    }
    // Every upsert row of a group at the group's newest position, each key once (a replayed
    // file may hold the same change twice).
    let mut seen: HashSet<u128, std::hash::BuildHasherDefault<Prehashed>> = HashSet::default();
    for (i, c) in controls.iter().enumerate() {
        for r in 0..c.op.len() {
            if !upsert(i, r) {
                continue;
            }
            let Some(&(wi, wr)) = winners.get(&c.by[r]) else {
                continue;
            };
            let winning = controls[wi as usize].position[wr as usize];
            if c.position[r] == winning
                && c.position[r] > truncated
                && upsert(wi as usize, wr as usize)
                && seen.insert(c.full[r])
            {
                picked[i].push(r as u32);
            }
        }
    }
    picked
}

/// The new current state being written: copied row groups and row groups of gathered rows.
struct Output {
    schema: SchemaRef,
    writer: SerializedFileWriter<Vec<u8>>,
    factory: ArrowRowGroupWriterFactory,
    row_group_rows: usize,
    /// Gathered rows not yet written (in the output schema).
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    /// Row groups copied so far.
    copied: usize,
}

impl Output {
    fn new(
        schema: &SchemaRef,
        properties: parquet::file::properties::WriterProperties,
        row_group_rows: usize,
    ) -> Result<Self, String> {
        let (writer, factory) = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(properties))
            .and_then(ArrowWriter::into_serialized_writer)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            schema: schema.clone(),
            writer,
            factory,
            row_group_rows: row_group_rows.max(1),
            pending: Vec::new(),
            pending_rows: 0,
            copied: 0,
        })
    }

    /// Copies every row group of `input`: `columns[j]` is its column holding output column j.
    fn copy(&mut self, input: &Input, columns: &[usize]) -> Result<(), String> {
        self.flush(true)?;
        let metadata = input.meta.metadata();
        let index = |group: usize, column: usize| {
            let column_index = metadata
                .column_index()
                .and_then(|c| c.get(group)?.get(column).cloned());
            let offset_index = metadata
                .offset_index()
                .and_then(|o| o.get(group)?.get(column).cloned());
            (column_index, offset_index)
        };
        for (g, group) in metadata.row_groups().iter().enumerate() {
            let mut row_group = self.writer.next_row_group().map_err(failed(&input.path))?;
            for &c in columns {
                let chunk = group.column(c);
                let (column_index, offset_index) = index(g, c);
                let close = ColumnCloseResult {
                    bytes_written: chunk.compressed_size() as u64,
                    rows_written: group.num_rows() as u64,
                    metadata: chunk.clone(),
                    bloom_filter: None,
                    column_index,
                    offset_index,
                };
                row_group
                    .append_column(&input.bytes, close)
                    .map_err(failed(&input.path))?;
            }
            row_group.close().map_err(failed(&input.path))?;
            self.copied += 1;
        }
        Ok(())
    }

    /// Decodes `input` and keeps its rows `rows` (ascending).
    fn gather(&mut self, input: &Input, rows: &[u32]) -> Result<(), String> {
        let mut wanted = rows.iter().peekable();
        let mut start = 0u32;
        for batch in input.read(None)? {
            let batch = batch?;
            let end = start + batch.num_rows() as u32;
            let mut keep = vec![false; batch.num_rows()];
            while let Some(&&r) = wanted.peek() {
                if r >= end {
                    break;
                }
                keep[(r - start) as usize] = true;
                wanted.next();
            }
            start = end;
            let keep = BooleanArray::from(keep);
            if keep.true_count() == 0 {
                continue;
            }
            let kept = arrow_select::filter::filter_record_batch(&batch, &keep)
                .map_err(|e| e.to_string())?;
            let columns: Vec<ArrayRef> = self
                .schema
                .fields()
                .iter()
                .map(|f| match kept.column_by_name(f.name()) {
                    Some(c) if c.data_type() == f.data_type() => c.clone(),
                    _ => new_null_array(f.data_type(), kept.num_rows()),
                })
                .collect();
            let unified =
                RecordBatch::try_new(self.schema.clone(), columns).map_err(|e| e.to_string())?;
            self.pending_rows += unified.num_rows();
            self.pending.push(unified);
            self.flush(false)?;
        }
        Ok(())
    }

    /// Writes the gathered rows as row groups of `row_group_rows` (and the rest, when `all`).
    fn flush(&mut self, all: bool) -> Result<(), String> {
        if self.pending_rows < self.row_group_rows && !(all && self.pending_rows > 0) {
            return Ok(());
        }
        let rows = arrow_select::concat::concat_batches(&self.schema, &self.pending)
            .map_err(|e| e.to_string())?;
        self.pending.clear();
        let mut offset = 0;
        while rows.num_rows() - offset >= self.row_group_rows || (all && offset < rows.num_rows()) {
            let n = self.row_group_rows.min(rows.num_rows() - offset);
            self.write_row_group(&rows.slice(offset, n))?;
            offset += n;
        }
        self.pending_rows = rows.num_rows() - offset;
        if self.pending_rows > 0 {
            self.pending.push(rows.slice(offset, self.pending_rows));
        }
        Ok(())
    }

    fn write_row_group(&mut self, batch: &RecordBatch) -> Result<(), String> {
        let error = |e: parquet::errors::ParquetError| e.to_string();
        let mut writers = self
            .factory
            .create_column_writers(self.writer.flushed_row_groups().len())
            .map_err(error)?;
        let mut next = writers.iter_mut();
        for (field, array) in self.schema.fields().iter().zip(batch.columns()) {
            for leaf in compute_leaves(field, array).map_err(error)? {
                next.next()
                    .ok_or("more leaves than column writers")?
                    .write(&leaf)
                    .map_err(error)?;
            }
        }
        let mut row_group = self.writer.next_row_group().map_err(error)?;
        for writer in writers {
            writer
                .close()
                .and_then(|chunk| chunk.append_to_row_group(&mut row_group))
                .map_err(error)?;
        }
        row_group.close().map_err(error)?;
        Ok(())
    }

    fn finish(mut self) -> Result<Bytes, String> {
        self.flush(true)?;
        self.writer
            .into_inner()
            .map(Bytes::from)
            .map_err(|e| e.to_string())
    }
}

/// A 128-bit FNV-1a hash of a row's values in `columns`: keys are compared by hash, and a
/// collision among billions of keys is negligible (the data is not adversarial).
fn row_hash(columns: &[Option<ArrayRef>], row: usize) -> u128 {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Date32Type, Float64Type, Int64Type, TimestampMicrosecondType};
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut hash: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    let mut feed = |bytes: &[u8], tag: u8| {
        for &b in std::iter::once(&tag).chain(bytes) {
            hash ^= u128::from(b);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    for column in columns {
        let Some(c) = column else {
            feed(&[], 0);
            continue;
        };
        if c.is_null(row) {
            feed(&[], 1);
            continue;
        }
        match c.data_type() {
            DataType::Utf8 => feed(c.as_string::<i32>().value(row).as_bytes(), 2),
            DataType::Int64 => feed(&c.as_primitive::<Int64Type>().value(row).to_le_bytes(), 3),
            DataType::Float64 => feed(&c.as_primitive::<Float64Type>().value(row).to_le_bytes(), 4),
            DataType::Boolean => feed(&[u8::from(c.as_boolean().value(row))], 5),
            DataType::Date32 => feed(&c.as_primitive::<Date32Type>().value(row).to_le_bytes(), 6),
            DataType::Timestamp(..) => feed(
                &c.as_primitive::<TimestampMicrosecondType>()
                    .value(row)
                    .to_le_bytes(),
                7,
            ),
            _ => feed(&[], 8),
        }
    }
    hash
}

/// Hashes `u128` keys that are hashes already: their low bits are the hash.
#[derive(Default)]
struct Prehashed(u64);

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

/// A `_position` text (`{major:020}.{minor:020}`) as one number that sorts the same.
fn position_number(text: &str) -> u128 {
    let (major, minor) = text.split_once('.').unwrap_or((text, "0"));
    (u128::from(major.parse::<u64>().unwrap_or(0)) << 64)
        | u128::from(minor.parse::<u64>().unwrap_or(0))
}
