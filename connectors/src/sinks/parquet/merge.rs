//! The merge of a compaction: the previous current state and the change-log rows past it, into
//! the new current state.
//!
//! The inputs are local files (spooled from the store by [`compact`](super::compact)), and so
//! is the new state. Two passes over the inputs. The first decodes only the columns that decide
//! which rows survive (`_position`, `_op`, the key and group columns) and hands them to
//! [`survivors`](super::survivors), which picks the survivors partition by partition. The second
//! writes them, input by input:
//! - an input whose rows all survive and whose columns are exactly the output's has its column
//!   chunks copied into the new file as they are, without decoding or encoding them: every
//!   change file of an append-only load, and a previous state that no new change touches;
//! - any other input is decoded, its surviving rows are gathered, and they are encoded anew.
//!
//! Memory does not grow with the table: the inputs' footers, one batch of decoded rows
//! ([`READ_BATCH_ROWS`]), one partition of survivor records (see
//! [`survivors`](super::survivors)), and the row group being encoded (compressed, at most
//! `row_group_rows` rows). The disk holds the inputs, the spill files and the new file.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, new_null_array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use object_store::path::Path;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::arrow_writer::{ArrowColumnWriter, ArrowRowGroupWriterFactory, compute_leaves};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::column::writer::ColumnCloseResult;
use parquet::file::metadata::PageIndexPolicy;
use parquet::file::writer::SerializedFileWriter;

use super::compact::{READ_BATCH_ROWS, string_column};
use super::encode::{self, META_GROUP, META_KEY, META_MERGED_THROUGH, OP, POSITION};
use super::survivors::{Partitions, Record, SurvivorRows};

/// Buffer of the new file being written.
const OUTPUT_BUFFER_BYTES: usize = 1024 * 1024;

/// A merged current state.
pub(super) struct Merged {
    /// The new state's file, and its size.
    pub file: std::path::PathBuf,
    pub size: u64,
    pub rows: usize,
    /// The newest position merged.
    pub through: String,
    /// Row groups copied as they were.
    pub copied: usize,
    /// Partitions the survivors were chosen in, one at a time.
    pub partitions: usize,
    /// The most survivor records held in memory at once.
    pub peak_records: usize,
}

/// One input: the previous current state (no `_op`: every row is live) or a change-log file.
struct Input {
    path: Path,
    file: File,
    meta: ArrowReaderMetadata,
    previous: bool,
}

fn failed(path: &Path) -> impl Fn(parquet::errors::ParquetError) -> String + '_ {
    move |e| format!("{path}: {e}")
}

impl Input {
    fn new(path: Path, file: File, previous: bool) -> Result<Self, String> {
        // The page index comes along so that copied chunks keep theirs.
        let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
        let meta = ArrowReaderMetadata::load(&file, options).map_err(failed(&path))?;
        Ok(Self {
            path,
            file,
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
        let file = self
            .file
            .try_clone()
            .map_err(|e| format!("{}: {e}", self.path))?;
        let mut builder =
            ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.meta.clone())
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

    /// The first pass: hands the position, op and key hashes of every row to `partitions`;
    /// returns the newest position among the change-log rows merged now.
    fn control(
        &self,
        index: u32,
        by: &[String],
        full: &[String],
        merged_through: &str,
        partitions: &mut Partitions,
    ) -> Result<Option<(u128, String)>, String> {
        let mut names: Vec<&str> = vec![POSITION, OP];
        names.extend(by.iter().chain(full).map(String::as_str));
        let mut newest: Option<(u128, String)> = None;
        let mut row = 0u32;
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
                    Some(_) if !merged_through.is_empty() && text <= merged_through => None,
                    Some(ops) => Some(ops.value(r).bytes().next().unwrap_or(b'u')),
                    None => Some(b'u'),
                };
                let position = position_number(text);
                let at = row;
                row += 1;
                let Some(op) = op else { continue };
                if !self.previous && newest.as_ref().is_none_or(|(n, _)| position > *n) {
                    newest = Some((position, text.to_owned()));
                }
                if op == b't' {
                    partitions.truncate(position);
                    continue;
                }
                partitions.push(Record {
                    by: row_hash(&by_columns, r),
                    full: if full.is_empty() {
                        0
                    } else {
                        row_hash(&full_columns, r)
                    },
                    position,
                    op,
                    input: index,
                    row: at,
                })?;
            }
        }
        Ok(newest)
    }

    /// Whether its column chunks can be copied into a file of `fields`: the same columns, in
    /// the same order, with the same Parquet descriptions. Returns the source column of each.
    fn copyable(
        &self,
        fields: &[Field],
        out: &SerializedFileWriter<BufWriter<File>>,
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

/// Where the merge works and how much it holds: the new state is written to `dir/current.parquet`
/// and the spill files go under `dir`; survivors are chosen about `partition_rows` records at a
/// time.
pub(super) struct Workspace<'a> {
    pub dir: &'a std::path::Path,
    pub partition_rows: usize,
}

/// Merges the previous current state with the change-log files past it (CPU and local disk
/// work: decoding, hashing keys, choosing survivors, copying or gathering rows, encoding).
pub(super) fn merge(
    previous: Option<(Path, File)>,
    changes: Vec<(Path, File)>,
    merged_through: &str,
    zstd_level: i32,
    row_group_rows: usize,
    workspace: &Workspace<'_>,
) -> Result<Merged, String> {
    let mut inputs = Vec::with_capacity(changes.len() + 1);
    if let Some((path, file)) = previous {
        inputs.push(Input::new(path, file, true)?);
    }
    for (path, file) in changes {
        inputs.push(Input::new(path, file, false)?);
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
    let total = inputs.iter().map(Input::rows).sum();
    let mut partitions = Partitions::new(total, workspace.partition_rows, workspace.dir)?;
    let mut newest: Option<(u128, String)> = None;
    for (i, input) in inputs.iter().enumerate() {
        let own = input.control(i as u32, &by, &full, merged_through, &mut partitions)?;
        if own.as_ref().map(|o| o.0) > newest.as_ref().map(|n| n.0) {
            newest = own;
        }
    }
    let mut chosen = partitions.choose(!group.is_empty(), inputs.len())?;
    // The newest position merged: the newest change-log row past the previous merge.
    let newest = newest.map_or_else(|| merged_through.to_owned(), |(_, text)| text);

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
    let path = workspace.dir.join("current.parquet");
    let mut out = Output::new(
        &path,
        &schema,
        encode::properties(zstd_level, row_group_rows),
        row_group_rows,
    )?;
    for (input, &count) in inputs.iter().zip(&chosen.counts) {
        if count == 0 {
            continue;
        }
        let copy = (count == input.rows())
            .then(|| input.copyable(&fields, &out.writer))
            .flatten();
        match copy {
            Some(columns) => {
                out.copy(input, &columns)?;
                chosen.rows.skip(count)?;
            }
            None => out.gather(input, &mut chosen.rows, count)?,
        }
    }
    let copied = out.copied;
    let size = out.finish()?;
    Ok(Merged {
        file: path,
        size,
        rows: chosen.counts.iter().sum(),
        through: newest,
        copied,
        partitions: chosen.partitions,
        peak_records: chosen.peak_records,
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

/// The new current state being written, to a local file: copied row groups and row groups of
/// gathered rows, each encoded as its rows come (one row group's pages in memory at a time).
struct Output {
    schema: SchemaRef,
    writer: SerializedFileWriter<BufWriter<File>>,
    factory: ArrowRowGroupWriterFactory,
    row_group_rows: usize,
    /// The row group being encoded: its column writers and rows so far.
    open: Option<(Vec<ArrowColumnWriter>, usize)>,
    /// Row groups copied so far.
    copied: usize,
}

fn parquet_error(e: parquet::errors::ParquetError) -> String {
    e.to_string()
}

impl Output {
    fn new(
        path: &std::path::Path,
        schema: &SchemaRef,
        properties: parquet::file::properties::WriterProperties,
        row_group_rows: usize,
    ) -> Result<Self, String> {
        let file =
            File::create(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let sink = BufWriter::with_capacity(OUTPUT_BUFFER_BYTES, file);
        let (writer, factory) = ArrowWriter::try_new(sink, schema.clone(), Some(properties))
            .and_then(ArrowWriter::into_serialized_writer)
            .map_err(parquet_error)?;
        Ok(Self {
            schema: schema.clone(),
            writer,
            factory,
            row_group_rows: row_group_rows.max(1),
            open: None,
            copied: 0,
        })
    }

    /// Copies every row group of `input`: `columns[j]` is its column holding output column j.
    fn copy(&mut self, input: &Input, columns: &[usize]) -> Result<(), String> {
        self.close_row_group()?;
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
                    .append_column(&input.file, close)
                    .map_err(failed(&input.path))?;
            }
            row_group.close().map_err(failed(&input.path))?;
            self.copied += 1;
        }
        Ok(())
    }

    /// Decodes `input` and keeps its next `count` rows of `rows` (ascending).
    fn gather(
        &mut self,
        input: &Input,
        rows: &mut SurvivorRows,
        count: usize,
    ) -> Result<(), String> {
        let mut left = count;
        let mut held: Option<u32> = None;
        let mut start = 0u32;
        for batch in input.read(None)? {
            if left == 0 && held.is_none() {
                break;
            }
            let batch = batch?;
            let end = start + batch.num_rows() as u32;
            let mut keep = vec![false; batch.num_rows()];
            loop {
                let r = match held.take() {
                    Some(r) => r,
                    None if left > 0 => {
                        left -= 1;
                        rows.next_row()?
                    }
                    None => break,
                };
                if r >= end {
                    held = Some(r);
                    break;
                }
                keep[(r - start) as usize] = true;
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
            self.write(&unified)?;
        }
        if left > 0 || held.is_some() {
            return Err(format!("{}: fewer rows than its survivors", input.path));
        }
        Ok(())
    }

    /// Encodes `batch` into row groups of `row_group_rows`, the last one left open.
    fn write(&mut self, batch: &RecordBatch) -> Result<(), String> {
        let mut offset = 0;
        while offset < batch.num_rows() {
            let (writers, rows) = match &mut self.open {
                Some(open) => open,
                None => {
                    let writers = self
                        .factory
                        .create_column_writers(self.writer.flushed_row_groups().len())
                        .map_err(parquet_error)?;
                    self.open.insert((writers, 0))
                }
            };
            let n = (self.row_group_rows - *rows).min(batch.num_rows() - offset);
            let slice = batch.slice(offset, n);
            let mut next = writers.iter_mut();
            for (field, array) in self.schema.fields().iter().zip(slice.columns()) {
                for leaf in compute_leaves(field, array).map_err(parquet_error)? {
                    next.next()
                        .ok_or("more leaves than column writers")?
                        .write(&leaf)
                        .map_err(parquet_error)?;
                }
            }
            *rows += n;
            offset += n;
            if *rows == self.row_group_rows {
                self.close_row_group()?;
            }
        }
        Ok(())
    }

    /// Writes the row group being encoded, if any.
    fn close_row_group(&mut self) -> Result<(), String> {
        let Some((writers, _)) = self.open.take() else {
            return Ok(());
        };
        let mut row_group = self.writer.next_row_group().map_err(parquet_error)?;
        for writer in writers {
            writer
                .close()
                .and_then(|chunk| chunk.append_to_row_group(&mut row_group))
                .map_err(parquet_error)?;
        }
        row_group.close().map_err(parquet_error)?;
        Ok(())
    }

    /// Completes the file; returns its size.
    fn finish(mut self) -> Result<u64, String> {
        self.close_row_group()?;
        let sink = self.writer.into_inner().map_err(parquet_error)?;
        let file = sink
            .into_inner()
            .map_err(|e| format!("cannot write the new state: {}", e.error()))?;
        let size = file
            .metadata()
            .map_err(|e| format!("cannot write the new state: {e}"))?
            .len();
        Ok(size)
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

/// A `_position` text (`{major:020}.{minor:020}`) as one number that sorts the same.
fn position_number(text: &str) -> u128 {
    let (major, minor) = text.split_once('.').unwrap_or((text, "0"));
    (u128::from(major.parse::<u64>().unwrap_or(0)) << 64)
        | u128::from(minor.parse::<u64>().unwrap_or(0))
}
