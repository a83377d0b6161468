//! Flat rows to Arrow record batches and Parquet bytes, and the metadata each file carries.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Date32Builder, Float64Builder, Int64Builder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, NullArray, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use refract_schemas::Offset;
use refract_schemas::write::flat::{FlatChange, FlatSchema, FlatType, FlatValue};

/// `_op`: `u` upsert, `d` delete, `t` truncate.
pub(crate) const OP: &str = "_op";
/// `_position`: the source position, zero-padded so that text order is position order.
pub(crate) const POSITION: &str = "_position";
/// `_commit_ts`: the source transaction's commit time.
pub(crate) const COMMIT_TS: &str = "_commit_ts";

/// File metadata: the key columns, comma-separated.
pub(crate) const META_KEY: &str = "refract.key";
/// File metadata: an exploded table's parent-key columns (rows replaced per group).
pub(crate) const META_GROUP: &str = "refract.group";
/// File metadata: the table's schema version.
pub(crate) const META_SCHEMA_VERSION: &str = "refract.schema_version";
/// File metadata (current state): the newest position merged into it.
pub(crate) const META_MERGED_THROUGH: &str = "refract.merged_through";

/// Arrow type of a flat column; timestamps are UTC microseconds.
pub(crate) fn data_type(ty: FlatType) -> DataType {
    match ty {
        FlatType::Unknown => DataType::Null,
        FlatType::Bool => DataType::Boolean,
        FlatType::Int64 => DataType::Int64,
        FlatType::Float64 => DataType::Float64,
        FlatType::String | FlatType::Json => DataType::Utf8,
        FlatType::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        FlatType::Date => DataType::Date32,
    }
}

/// The Arrow schema of a change-log file of `schema`: `_op`, `_position`, `_commit_ts`, then
/// the table's columns, with the key and schema version in the metadata.
pub(crate) fn change_schema(schema: &FlatSchema) -> SchemaRef {
    let mut fields = vec![
        Field::new(OP, DataType::Utf8, false),
        Field::new(POSITION, DataType::Utf8, false),
        Field::new(COMMIT_TS, data_type(FlatType::Timestamp), true),
    ];
    for c in &schema.columns {
        let mut field = Field::new(&c.name, data_type(c.ty), true);
        if c.ty == FlatType::Json {
            field = field.with_metadata(HashMap::from([(
                "refract.type".to_owned(),
                "json".to_owned(),
            )]));
        }
        fields.push(field);
    }
    let names = |idx: &[usize]| {
        idx.iter()
            .map(|&i| schema.columns[i].name.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut metadata = HashMap::from([
        (META_KEY.to_owned(), names(&schema.key)),
        (META_SCHEMA_VERSION.to_owned(), schema.version.to_string()),
    ]);
    if !schema.group.is_empty() {
        metadata.insert(META_GROUP.to_owned(), names(&schema.group));
    }
    Arc::new(Schema::new_with_metadata(fields, metadata))
}

/// Builds one column of values.
enum Column {
    Null(usize),
    Bool(BooleanBuilder),
    Int(Int64Builder),
    Float(Float64Builder),
    Str(StringBuilder),
    Micros(TimestampMicrosecondBuilder),
    Days(Date32Builder),
}

impl Column {
    fn new(ty: FlatType, rows: usize) -> Self {
        match ty {
            FlatType::Unknown => Column::Null(0),
            FlatType::Bool => Column::Bool(BooleanBuilder::with_capacity(rows)),
            FlatType::Int64 => Column::Int(Int64Builder::with_capacity(rows)),
            FlatType::Float64 => Column::Float(Float64Builder::with_capacity(rows)),
            FlatType::String | FlatType::Json => {
                Column::Str(StringBuilder::with_capacity(rows, rows * 16))
            }
            FlatType::Timestamp => Column::Micros(
                TimestampMicrosecondBuilder::with_capacity(rows).with_timezone("UTC"),
            ),
            FlatType::Date => Column::Days(Date32Builder::with_capacity(rows)),
        }
    }

    /// Appends `value`; the projection guarantees it fits the column's type.
    fn push(&mut self, value: Option<&FlatValue>) {
        match (self, value) {
            (Column::Null(n), _) => *n += 1,
            (Column::Bool(b), Some(FlatValue::Bool(v))) => b.append_value(*v),
            (Column::Bool(b), _) => b.append_null(),
            (Column::Int(b), Some(FlatValue::Int(v))) => b.append_value(*v),
            (Column::Int(b), _) => b.append_null(),
            (Column::Float(b), Some(FlatValue::Float(v))) => b.append_value(*v),
            (Column::Float(b), Some(FlatValue::Int(v))) => b.append_value(*v as f64),
            (Column::Float(b), _) => b.append_null(),
            (Column::Str(b), Some(FlatValue::Str(v))) => b.append_value(v),
            (Column::Str(b), _) => b.append_null(),
            (Column::Micros(b), Some(FlatValue::Micros(v))) => b.append_value(*v),
            (Column::Micros(b), _) => b.append_null(),
            (Column::Days(b), Some(FlatValue::Days(v))) => b.append_value(*v),
            (Column::Days(b), _) => b.append_null(),
        }
    }

    fn finish(self) -> ArrayRef {
        match self {
            Column::Null(n) => Arc::new(NullArray::new(n)),
            Column::Bool(mut b) => Arc::new(b.finish()),
            Column::Int(mut b) => Arc::new(b.finish()),
            Column::Float(mut b) => Arc::new(b.finish()),
            Column::Str(mut b) => Arc::new(b.finish()),
            Column::Micros(mut b) => Arc::new(b.finish()),
            Column::Days(mut b) => Arc::new(b.finish()),
        }
    }
}

/// One change-log row: the change and its position.
pub(crate) struct Row<'a> {
    pub change: &'a FlatChange,
    pub position: Offset,
}

/// Encodes rows of one table as a record batch of `schema` (the newest schema among them: the
/// older rows' missing trailing columns are null).
pub(crate) fn record_batch(
    schema: &FlatSchema,
    arrow: &SchemaRef,
    rows: &[Row<'_>],
) -> Result<RecordBatch, arrow_schema::ArrowError> {
    let n = rows.len();
    let mut op = StringBuilder::with_capacity(n, n);
    let mut position = StringBuilder::with_capacity(n, n * 41);
    let mut commit = TimestampMicrosecondBuilder::with_capacity(n).with_timezone("UTC");
    let mut columns: Vec<Column> = schema
        .columns
        .iter()
        .map(|c| Column::new(c.ty, n))
        .collect();
    let mut text = String::with_capacity(41);
    for row in rows {
        op.append_value(row.change.op.code());
        text.clear();
        row.position.write_sortable(&mut text);
        position.append_value(&text);
        commit.append_option(row.change.commit_ts_ms.map(|ms| ms.saturating_mul(1000)));
        for (i, column) in columns.iter_mut().enumerate() {
            column.push(row.change.values.get(i));
        }
    }
    let mut arrays: Vec<ArrayRef> = Vec::with_capacity(columns.len() + 3);
    arrays.push(Arc::new(op.finish()));
    arrays.push(Arc::new(position.finish()));
    arrays.push(Arc::new(commit.finish()));
    arrays.extend(columns.into_iter().map(Column::finish));
    RecordBatch::try_new(arrow.clone(), arrays)
}

/// Writer properties: zstd at `level`, `row_group_rows` rows per row group. `_position` and
/// `_commit_ts` are nearly unique per row: a dictionary would only cost time before Parquet
/// gives up on it.
pub(crate) fn properties(level: i32, row_group_rows: usize) -> WriterProperties {
    WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(level).unwrap_or_default(),
        ))
        .set_max_row_group_row_count(Some(row_group_rows))
        .set_column_dictionary_enabled(ColumnPath::from(POSITION), false)
        .set_column_dictionary_enabled(ColumnPath::from(COMMIT_TS), false)
        .build()
}

/// A Parquet file being written in memory.
pub(crate) type FileWriter = ArrowWriter<Vec<u8>>;

/// Starts a file of `schema`.
pub(crate) fn writer(
    schema: &SchemaRef,
    properties: WriterProperties,
) -> Result<FileWriter, parquet::errors::ParquetError> {
    ArrowWriter::try_new(Vec::new(), schema.clone(), Some(properties))
}
