//! Bounded, typed parsing of the requests a client sends: what a request can make the daemon
//! hold is at most about twice its frame, whatever it holds.
//!
//! serde's internally tagged enums (`{"call": "status", "job": 1}`) buffer every field of the
//! object into a generic tree before they look at the tag: a frame of tiny JSON objects becomes
//! a tree twenty times its size. Requests and job specs are therefore read here as an object of
//! at most [`MAX_FIELDS`] fields whose values are kept as raw JSON text, the tag picked out, and
//! each field then parsed into its own bounded type: strings and paths of a bounded length,
//! lists of a bounded count (the parse stops at the first element past it), no generic value.

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// Fields an object of the protocol may have, its tag included.
pub const MAX_FIELDS: usize = 8;

/// Bytes a field name may take.
const MAX_KEY_BYTES: usize = 32;

/// An object's fields as raw JSON text, in the order sent.
pub(crate) struct Fields {
    fields: Vec<(String, Box<RawValue>)>,
}

impl<'de> serde::Deserialize<'de> for Fields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an object of at most {MAX_FIELDS} fields")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut fields: Vec<(String, Box<RawValue>)> = Vec::new();
                while let Some(key) = map.next_key::<Key>()? {
                    if fields.len() == MAX_FIELDS {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_FIELDS} fields in an object"
                        )));
                    }
                    if fields.iter().any(|(k, _)| *k == key.0) {
                        return Err(de::Error::custom(format!("duplicate field `{}`", key.0)));
                    }
                    fields.push((key.0, map.next_value()?));
                }
                Ok(Fields { fields })
            }
        }
        d.deserialize_map(V)
    }
}

/// A field name, refused past [`MAX_KEY_BYTES`] before it is copied.
struct Key(String);

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(BoundedStr {
            what: "a field name",
            max: MAX_KEY_BYTES,
        })
        .map(Key)
    }
}

/// Visits a string of at most `max` bytes.
struct BoundedStr {
    what: &'static str,
    max: usize,
}

impl<'de> Visitor<'de> for BoundedStr {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} (a string of at most {} bytes)", self.what, self.max)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        if v.len() > self.max {
            return Err(E::custom(format!(
                "{}: {} bytes (at most {})",
                self.what,
                v.len(),
                self.max
            )));
        }
        Ok(v.to_owned())
    }
}

impl Fields {
    /// Removes field `name` and parses it with `parse`.
    fn take<T, E: de::Error>(
        &mut self,
        name: &str,
        parse: impl FnOnce(&str) -> serde_json::Result<T>,
    ) -> Result<Option<T>, E> {
        let Some(at) = self.fields.iter().position(|(k, _)| k == name) else {
            return Ok(None);
        };
        let (_, raw) = self.fields.swap_remove(at);
        parse(raw.get())
            .map(Some)
            .map_err(|e| E::custom(format!("{name}: {e}")))
    }

    /// Field `name`, which must be there.
    pub(crate) fn required<T: DeserializeOwned, E: de::Error>(
        &mut self,
        name: &str,
    ) -> Result<T, E> {
        self.optional(name)?
            .ok_or_else(|| E::custom(format!("missing field `{name}`")))
    }

    /// Field `name` if sent (`null` counts as absent).
    pub(crate) fn optional<T: DeserializeOwned, E: de::Error>(
        &mut self,
        name: &str,
    ) -> Result<Option<T>, E> {
        Ok(self
            .take(name, |raw| serde_json::from_str::<Option<T>>(raw))?
            .flatten())
    }

    /// String field `name` of at most `max` bytes, if sent.
    pub(crate) fn text<E: de::Error>(
        &mut self,
        name: &'static str,
        max: usize,
    ) -> Result<Option<String>, E> {
        Ok(self
            .take(name, |raw| {
                let mut d = serde_json::Deserializer::from_str(raw);
                let v = d.deserialize_option(OptionOf(BoundedStr { what: name, max }))?;
                d.end().map(|()| v)
            })?
            .flatten())
    }

    /// Path field `name` ([`crate::MAX_PATH_BYTES`] at most, no NUL byte), if sent.
    pub(crate) fn path<E: de::Error>(&mut self, name: &'static str) -> Result<Option<PathBuf>, E> {
        let Some(text) = self.text(name, crate::MAX_PATH_BYTES)? else {
            return Ok(None);
        };
        if text.contains('\0') {
            return Err(E::custom(format!("{name}: a path with a NUL byte")));
        }
        Ok(Some(PathBuf::from(text)))
    }

    /// A list of at most `count` strings of at most `max` bytes each, if sent.
    pub(crate) fn texts<E: de::Error>(
        &mut self,
        name: &'static str,
        count: usize,
        max: usize,
    ) -> Result<Option<Vec<String>>, E> {
        self.take(name, |raw| {
            let mut d = serde_json::Deserializer::from_str(raw);
            let v = d.deserialize_seq(BoundedSeq {
                what: name,
                count,
                max,
            })?;
            d.end().map(|()| v)
        })
    }

    /// The tag field `name`: what kind of object this is.
    pub(crate) fn tag<E: de::Error>(&mut self, name: &'static str) -> Result<String, E> {
        self.text(name, MAX_KEY_BYTES)?
            .ok_or_else(|| E::custom(format!("missing field `{name}`")))
    }

    /// Refuses the fields left: none the object's kind has.
    pub(crate) fn finish<E: de::Error>(self, kind: &str) -> Result<(), E> {
        match self.fields.first() {
            Some((k, _)) => Err(E::custom(format!("unknown field `{k}` of `{kind}`"))),
            None => Ok(()),
        }
    }
}

/// `null` or what `V` visits.
struct OptionOf<V>(V);

impl<'de, V: Visitor<'de>> Visitor<'de> for OptionOf<V> {
    type Value = Option<V::Value>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.expecting(f)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self.0).map(Some)
    }
}

/// A list of bounded strings: the parse stops at the first element past the count.
struct BoundedSeq {
    what: &'static str,
    count: usize,
    max: usize,
}

impl<'de> Visitor<'de> for BoundedSeq {
    type Value = Vec<String>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}: a list of at most {} strings", self.what, self.count)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
        let mut out = Vec::new();
        while let Some(s) = seq.next_element_seed(StrSeed(&self))? {
            if out.len() == self.count {
                return Err(de::Error::custom(format!(
                    "{}: more than {} entries",
                    self.what, self.count
                )));
            }
            out.push(s);
        }
        Ok(out)
    }
}

struct StrSeed<'a>(&'a BoundedSeq);

impl<'de> de::DeserializeSeed<'de> for StrSeed<'_> {
    type Value = String;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_str(BoundedStr {
            what: self.0.what,
            max: self.0.max,
        })
    }
}

/// A JSON list of at most `count` elements kept as raw text each (what a serve job reads its
/// queries with: one element parsed at a time, none past the count).
pub fn raw_list(text: &str, count: usize) -> serde_json::Result<Vec<Box<RawValue>>> {
    struct V(usize);
    impl<'de> Visitor<'de> for V {
        type Value = Vec<Box<RawValue>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a list of at most {} elements", self.0)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(e) = seq.next_element()? {
                if out.len() == self.0 {
                    return Err(de::Error::custom(format!("more than {} elements", self.0)));
                }
                out.push(e);
            }
            Ok(out)
        }
    }
    let mut d = serde_json::Deserializer::from_str(text);
    let v = d.deserialize_seq(V(count))?;
    d.end().map(|()| v)
}
