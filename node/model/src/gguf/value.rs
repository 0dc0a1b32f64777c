//! GGUF metadata values.

use std::fmt;

/// The type tag of a metadata value, by its GGUF id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The type with GGUF id `id`.
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes in a file (used to bound counts).
    pub fn min_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value. Floats keep their exact bits, so a file round-trips byte for byte.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// An array of values all of type `elem` (arrays may nest).
    Array {
        elem: ValueType,
        items: Vec<Value>,
    },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// This value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array { .. } => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// An integer value of any width that fits in u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float value (f32 or f64).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array's items.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array { items, .. } => Some(items),
            _ => None,
        }
    }

    /// A JSON rendering for `inspect --json` (long arrays are summarized by the caller).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Value::U8(v) => json!(v),
            Value::I8(v) => json!(v),
            Value::U16(v) => json!(v),
            Value::I16(v) => json!(v),
            Value::U32(v) => json!(v),
            Value::I32(v) => json!(v),
            Value::F32(v) => json!(v),
            Value::Bool(v) => json!(v),
            Value::String(v) => json!(v),
            Value::Array { items, .. } => items.iter().map(Value::to_json).collect(),
            Value::U64(v) => json!(v),
            Value::I64(v) => json!(v),
            Value::F64(v) => json!(v),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array { elem, items } => {
                write!(f, "[{elem:?}; {}]", items.len())?;
                if !items.is_empty() && items.len() <= 8 {
                    let shown: Vec<String> = items.iter().map(|v| v.to_string()).collect();
                    write!(f, " {}", shown.join(", "))?;
                }
                Ok(())
            }
            other => write!(f, "{}", other.to_json()),
        }
    }
}
