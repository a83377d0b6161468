//! Avro bodies read straight into the types the JSON codec reads ([`crate::debezium::Envelope`],
//! [`crate::Row`], `serde_json::Value`), as a serde [`Deserializer`] over the binary body.
//!
//! The general path reads a body into apache-avro's value tree, turns that into JSON
//! ([`super::to_json`]) and deserializes the envelope from the JSON: three trees, every field
//! name allocated in each. This one walks the body once, with the writer schema compiled into a
//! [`Plan`], and hands each value to the deserializing type as [`super::to_json`] would have
//! given it: `int`/`long` (and the logical types on them) as integers, `float` through its
//! shortest text, `bytes`, `fixed` and decimals as base64 text (an empty decimal as null),
//! enums as their symbol, records and maps as maps, a union as its branch. The tests hold the
//! two paths equal value for value.
//!
//! A schema with a type read in another way (`uuid`, big-decimal, a duration not of 12 bytes)
//! gets no plan, and its bodies take the general path.

use std::collections::HashMap;
use std::fmt;

use apache_avro::Schema;
use apache_avro::schema::{InnerDecimalSchema, Name, NamespaceRef, ResolvedSchema};
use base64::Engine as _;
use serde::Deserialize;
use serde::de::value::BorrowedStrDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::whole_body;

/// Containers (records, arrays, maps) a body may nest: a recursive schema would otherwise let a
/// hostile body nest until the stack ends.
const MAX_DEPTH: usize = 128;

/// One type of a compiled schema; children are indexes into [`Plan::nodes`].
#[derive(Debug)]
enum Node {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Bytes,
    String,
    /// `fixed`, and a `duration` (12 bytes): base64 text, as `bytes`.
    Fixed(usize),
    /// A decimal on `bytes` (`None`) or on a `fixed` of that size.
    Decimal(Option<usize>),
    Enum(Vec<String>),
    Array(usize),
    Map(usize),
    Record(Vec<(String, usize)>),
    Union(Vec<usize>),
}

/// A writer schema compiled for reading bodies; its root is node 0.
#[derive(Debug)]
pub(crate) struct Plan {
    nodes: Vec<Node>,
}

impl Plan {
    /// The plan of `schema`; `None` when one of its types is read in another way (see the
    /// module documentation) or a reference cannot be resolved.
    pub(crate) fn new(schema: &Schema) -> Option<Self> {
        let resolved = ResolvedSchema::try_from(schema).ok()?;
        let mut compiler = Compiler {
            nodes: Vec::new(),
            compiled: HashMap::new(),
            names: resolved.get_names(),
        };
        compiler.compile(schema, None)?;
        Some(Self {
            nodes: compiler.nodes,
        })
    }

    /// Whether the schema is a record (read as a map of its fields).
    pub(crate) fn is_record(&self) -> bool {
        matches!(self.nodes.first(), Some(Node::Record(_)))
    }

    /// Reads one body, which must be consumed whole, into a `T`.
    pub(crate) fn read<'a, T: Deserialize<'a>>(&'a self, body: &'a [u8]) -> Result<T, String> {
        let mut input = Input {
            plan: self,
            rest: body,
            depth: 0,
        };
        let value = T::deserialize(At {
            input: &mut input,
            node: 0,
        })
        .map_err(|e| e.to_string())?;
        whole_body(input.rest, body)?;
        Ok(value)
    }
}

struct Compiler<'s> {
    nodes: Vec<Node>,
    /// The named types compiled so far (a reference to one is its node).
    compiled: HashMap<Name, usize>,
    names: &'s HashMap<Name, &'s Schema>,
}

impl Compiler<'_> {
    fn compile(&mut self, schema: &Schema, namespace: NamespaceRef<'_>) -> Option<usize> {
        if let Schema::Ref { name } = schema {
            let name = name.fully_qualified_name(namespace);
            if let Some(&id) = self.compiled.get(&*name) {
                return Some(id);
            }
            let named = *self.names.get(&*name)?;
            return self.compile(named, name.namespace());
        }
        let id = self.nodes.len();
        // Taken now, so that a named type's own references find it.
        self.nodes.push(Node::Null);
        let node = match schema {
            Schema::Null => Node::Null,
            Schema::Boolean => Node::Boolean,
            Schema::Int | Schema::Date | Schema::TimeMillis => Node::Int,
            Schema::Long
            | Schema::TimeMicros
            | Schema::TimestampMillis
            | Schema::TimestampMicros
            | Schema::TimestampNanos
            | Schema::LocalTimestampMillis
            | Schema::LocalTimestampMicros
            | Schema::LocalTimestampNanos => Node::Long,
            Schema::Float => Node::Float,
            Schema::Double => Node::Double,
            Schema::Bytes => Node::Bytes,
            Schema::String => Node::String,
            Schema::Fixed(f) => {
                self.name(&f.name, namespace, id);
                Node::Fixed(f.size)
            }
            Schema::Duration(f) if f.size == 12 => Node::Fixed(12),
            Schema::Decimal(d) => Node::Decimal(match &d.inner {
                InnerDecimalSchema::Bytes => None,
                InnerDecimalSchema::Fixed(f) => Some(f.size),
            }),
            Schema::Enum(e) => {
                self.name(&e.name, namespace, id);
                Node::Enum(e.symbols.clone())
            }
            Schema::Array(a) => Node::Array(self.compile(&a.items, namespace)?),
            Schema::Map(m) => Node::Map(self.compile(&m.types, namespace)?),
            Schema::Union(u) => Node::Union(
                u.variants()
                    .iter()
                    .map(|v| self.compile(v, namespace))
                    .collect::<Option<_>>()?,
            ),
            Schema::Record(r) => {
                let inner = self.name(&r.name, namespace, id);
                let fields = r
                    .fields
                    .iter()
                    .map(|f| Some((f.name.clone(), self.compile(&f.schema, inner.as_deref())?)))
                    .collect::<Option<_>>()?;
                Node::Record(fields)
            }
            Schema::Duration(_) | Schema::Uuid(_) | Schema::BigDecimal | Schema::Ref { .. } => {
                return None;
            }
        };
        self.nodes[id] = node;
        Some(id)
    }

    /// Notes named type `name` as node `id`; its namespace, which its fields' names are in.
    fn name(&mut self, name: &Name, namespace: NamespaceRef<'_>, id: usize) -> Option<String> {
        let full = name.fully_qualified_name(namespace).into_owned();
        let inner = full.namespace().map(str::to_owned);
        self.compiled.insert(full, id);
        inner
    }
}

/// Why a body could not be read: it is corrupt (made with [`Error`]), or what it holds is not
/// what the type read from it needs ([`de::Error::custom`], worded as the JSON path words it).
#[derive(Debug)]
pub(crate) struct Error {
    message: String,
    corrupt: bool,
}

fn corrupt(message: String) -> Error {
    Error {
        message,
        corrupt: true,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.corrupt {
            "corrupt Avro body"
        } else {
            "unexpected record shape"
        };
        write!(f, "{what}: {}", self.message)
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error {
            message: msg.to_string(),
            corrupt: false,
        }
    }
}

/// The unread rest of a body.
struct Input<'a> {
    plan: &'a Plan,
    rest: &'a [u8],
    depth: usize,
}

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if n > self.rest.len() {
            return Err(corrupt(format!(
                "the body ends {} bytes before a value of {n}",
                n - self.rest.len()
            )));
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(taken)
    }

    /// A zigzag varint (Avro's `int` and `long`).
    fn long(&mut self) -> Result<i64, Error> {
        let mut z = 0u64;
        for i in 0..10 {
            let b = self.take(1)?[0];
            z |= u64::from(b & 0x7F) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(((z >> 1) as i64) ^ -((z & 1) as i64));
            }
        }
        Err(corrupt(
            "a variable-length integer longer than 10 bytes".into(),
        ))
    }

    fn int(&mut self) -> Result<i32, Error> {
        let n = self.long()?;
        i32::try_from(n).map_err(|_| corrupt(format!("{n} is out of range for an `int`")))
    }

    /// The bytes of a `bytes` or `string`: their length, then them.
    fn sized(&mut self) -> Result<&'a [u8], Error> {
        let n = self.long()?;
        let n = usize::try_from(n).map_err(|_| corrupt(format!("a negative length ({n})")))?;
        self.take(n)
    }

    /// The item count of the next block of an array or map (0 at the end).
    fn block(&mut self) -> Result<usize, Error> {
        let n = self.long()?;
        if n < 0 {
            // A negative count is followed by the block's size in bytes.
            self.long()?;
        }
        usize::try_from(n.unsigned_abs()).map_err(|_| corrupt(format!("a block of {n} items")))
    }

    fn nest(&mut self) -> Result<(), Error> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(corrupt(format!(
                "values nest deeper than {MAX_DEPTH} levels"
            )));
        }
        Ok(())
    }
}

fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The value of node `node` at the start of `input`.
struct At<'i, 'a> {
    input: &'i mut Input<'a>,
    node: usize,
}

impl<'de> Deserializer<'de> for At<'_, 'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let input = self.input;
        let plan = input.plan;
        match &plan.nodes[self.node] {
            Node::Null => visitor.visit_unit(),
            Node::Boolean => match input.take(1)?[0] {
                0 => visitor.visit_bool(false),
                1 => visitor.visit_bool(true),
                b => Err(corrupt(format!("{b:#04x} is not a boolean"))),
            },
            Node::Int => visitor.visit_i64(input.int()?.into()),
            Node::Long => visitor.visit_i64(input.long()?),
            Node::Float => {
                let f = f32::from_le_bytes(input.take(4)?.try_into().expect("4 bytes"));
                // As to_json: the float's shortest text, read as a double (0.1, not 0.10000000149).
                visitor.visit_f64(f.to_string().parse().unwrap_or(f64::NAN))
            }
            Node::Double => visitor.visit_f64(f64::from_le_bytes(
                input.take(8)?.try_into().expect("8 bytes"),
            )),
            Node::Bytes => visitor.visit_string(base64(input.sized()?)),
            Node::Fixed(n) => visitor.visit_string(base64(input.take(*n)?)),
            Node::Decimal(size) => {
                let bytes = match size {
                    Some(n) => input.take(*n)?,
                    None => input.sized()?,
                };
                if bytes.is_empty() {
                    visitor.visit_unit()
                } else {
                    visitor.visit_string(base64(bytes))
                }
            }
            Node::String => {
                let bytes = input.sized()?;
                let text = std::str::from_utf8(bytes)
                    .map_err(|e| corrupt(format!("a string that is not UTF-8: {e}")))?;
                visitor.visit_borrowed_str(text)
            }
            Node::Enum(symbols) => {
                let i = input.int()?;
                let symbol = usize::try_from(i).ok().and_then(|i| symbols.get(i));
                let symbol = symbol
                    .ok_or_else(|| corrupt(format!("enum index {i} of {}", symbols.len())))?;
                visitor.visit_borrowed_str(symbol)
            }
            Node::Union(variants) => {
                let node = variant(input, variants)?;
                At { input, node }.deserialize_any(visitor)
            }
            Node::Array(item) => {
                input.nest()?;
                let value = visitor.visit_seq(Items {
                    input: &mut *input,
                    item: *item,
                    left: 0,
                    ended: false,
                })?;
                input.depth -= 1;
                Ok(value)
            }
            Node::Map(value) => {
                input.nest()?;
                let out = visitor.visit_map(Entries {
                    input: &mut *input,
                    value: *value,
                    left: 0,
                    ended: false,
                })?;
                input.depth -= 1;
                Ok(out)
            }
            Node::Record(fields) => {
                input.nest()?;
                let value = visitor.visit_map(Fields {
                    input: &mut *input,
                    fields: fields.iter(),
                    next: None,
                })?;
                input.depth -= 1;
                Ok(value)
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let input = self.input;
        let node = match &input.plan.nodes[self.node] {
            Node::Union(variants) => variant(input, variants)?,
            _ => self.node,
        };
        match input.plan.nodes[node] {
            Node::Null => visitor.visit_none(),
            _ => visitor.visit_some(At { input, node }),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

/// The branch a union's value is of.
fn variant(input: &mut Input<'_>, variants: &[usize]) -> Result<usize, Error> {
    let i = input.long()?;
    usize::try_from(i)
        .ok()
        .and_then(|i| variants.get(i).copied())
        .ok_or_else(|| corrupt(format!("union branch {i} of {}", variants.len())))
}

/// The items of an array, block by block.
struct Items<'i, 'a> {
    input: &'i mut Input<'a>,
    item: usize,
    left: usize,
    ended: bool,
}

impl<'de> SeqAccess<'de> for Items<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        if !next_in_block(self.input, &mut self.left, &mut self.ended)? {
            return Ok(None);
        }
        seed.deserialize(At {
            input: &mut *self.input,
            node: self.item,
        })
        .map(Some)
    }
}

/// The entries of a map, block by block.
struct Entries<'i, 'a> {
    input: &'i mut Input<'a>,
    value: usize,
    left: usize,
    ended: bool,
}

impl<'de> MapAccess<'de> for Entries<'_, 'de> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        if !next_in_block(self.input, &mut self.left, &mut self.ended)? {
            return Ok(None);
        }
        let key = std::str::from_utf8(self.input.sized()?)
            .map_err(|e| corrupt(format!("a map key that is not UTF-8: {e}")))?;
        seed.deserialize(BorrowedStrDeserializer::new(key))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        seed.deserialize(At {
            input: &mut *self.input,
            node: self.value,
        })
    }
}

/// Whether an array or map has another item, reading the next block's count when one ends.
fn next_in_block(input: &mut Input<'_>, left: &mut usize, ended: &mut bool) -> Result<bool, Error> {
    while *left == 0 {
        if *ended {
            return Ok(false);
        }
        *left = input.block()?;
        if *left == 0 {
            *ended = true;
            return Ok(false);
        }
    }
    *left -= 1;
    Ok(true)
}

/// The fields of a record, in the schema's order.
struct Fields<'i, 'a> {
    input: &'i mut Input<'a>,
    fields: std::slice::Iter<'a, (String, usize)>,
    next: Option<usize>,
}

impl<'de> MapAccess<'de> for Fields<'_, 'de> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some((name, node)) = self.fields.next() else {
            return Ok(None);
        };
        self.next = Some(*node);
        seed.deserialize(BorrowedStrDeserializer::new(name))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let node = self
            .next
            .take()
            .ok_or_else(|| corrupt("a field's value asked for before its name".into()))?;
        seed.deserialize(At {
            input: &mut *self.input,
            node,
        })
    }
}

#[cfg(test)]
mod tests;
