//! The configuration as TOML text: `--set` overrides, keys that moved, and deserialization
//! errors turned into the key they are about.

use super::{Config, ConfigError, bad};

/// `section.key: message` for a deserialization error in `text`, found from the error's span.
pub(super) fn name_key(text: &str, e: &toml::de::Error) -> String {
    let key = e.span().and_then(|span| {
        let line_start = text[..span.start.min(text.len())]
            .rfind('\n')
            .map_or(0, |i| i + 1);
        let line = text[line_start..].lines().next()?.trim();
        if let Some(header) = line.strip_prefix('[') {
            return Some(header.trim_end_matches(']').to_owned());
        }
        let key = line.split('=').next()?.trim();
        let section = text[..line_start]
            .lines()
            .rev()
            .find_map(|l| l.trim().strip_prefix('['))
            .map(|h| h.trim_end_matches(']'));
        Some(match section {
            Some(section) => format!("{section}.{key}"),
            None => key.to_owned(),
        })
    });
    match key {
        Some(key) => format!("{key}: {}", in_words(&key, e.message())),
        None => format!("invalid configuration: {}", e.message()),
    }
}

/// Serde's Rust type names in a message about `key` said in words: `expected usize` becomes
/// `expected a whole number ≥ 1` (or `≥ 0` where the key takes 0, as the checks decide).
fn in_words(key: &str, message: &str) -> String {
    let whole = || {
        let floor = u8::from(Config::parse("", &[format!("{key}=0")]).is_err());
        format!("expected a whole number ≥ {floor}")
    };
    let mut out = message.to_owned();
    for ty in ["usize", "u64", "u32", "u16", "u8"] {
        let rust = format!("expected {ty}");
        if out.contains(&rust) {
            out = out.replace(&rust, &whole());
        }
    }
    for ty in ["f64", "f32"] {
        out = out.replace(&format!("expected {ty}"), "expected a number");
    }
    out
}

/// When a configuration's text was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Written {
    /// Now: a new run's, or a new override.
    Now,
    /// By a run, which may predate a key's move.
    Recorded,
}

/// Refuses what only a recorded configuration may still say: `storage.device` as a string,
/// which named the engine before `training.device` did (`[[storage.device]]` tables list the
/// members of a striped store).
pub(super) fn refuse_retired_keys(table: &toml::Table) -> Result<(), ConfigError> {
    let device = table
        .get("storage")
        .and_then(toml::Value::as_table)
        .and_then(|s| s.get("device"));
    match device {
        Some(toml::Value::String(engine)) => Err(bad(
            "storage.device",
            format!(
                "{engine:?} names the engine, which training.device does now: set \
                 training.device = {engine:?} (storage.device lists the [[storage.device]] \
                 members of a striped store)"
            ),
        )),
        Some(v) if !v.is_array() => Err(bad(
            "storage.device",
            "lists the [[storage.device]] members of a striped store (the engine is \
             training.device)",
        )),
        _ => Ok(()),
    }
}

/// Keys that moved: (old section, old key, new section, new key).
const MOVED_KEYS: [(&str, &str, &str, &str); 3] = [
    ("storage", "device", "training", "device"),
    ("training", "learning_rate", "optimizer", "learning_rate"),
    ("training", "adagrad_eps", "optimizer", "eps"),
];

/// Moves the keys of [`MOVED_KEYS`] to their new names, with a warning; both set is an error.
pub(super) fn move_deprecated_keys(table: &mut toml::Table) -> Result<(), ConfigError> {
    for (old_section, old_key, new_section, new_key) in MOVED_KEYS {
        let Some(section) = table
            .get_mut(old_section)
            .and_then(toml::Value::as_table_mut)
        else {
            continue;
        };
        // `storage.device` as a string is the old `training.device` (read only from a recorded
        // configuration, `refuse_retired_keys`); as tables, the devices of a striped store.
        let old = match section.get(old_key) {
            Some(v) if !v.is_array() => section.remove(old_key).expect("present"),
            _ => continue,
        };
        let section = table
            .entry(new_section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| bad(new_section, "must be a section"))?;
        if section.contains_key(new_key) {
            return Err(bad(
                &format!("{old_section}.{old_key}"),
                format!(
                    "the old name of {new_section}.{new_key}; set only {new_section}.{new_key}"
                ),
            ));
        }
        tracing::warn!("{old_section}.{old_key} is deprecated: it is now {new_section}.{new_key}");
        section.insert(new_key.into(), old);
    }
    Ok(())
}

pub(super) fn parse_value(text: &str) -> toml::Value {
    // Parse as the right-hand side of a TOML assignment; fall back to a bare string.
    toml::from_str::<toml::Table>(&format!("v = {text}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(text.to_owned()))
}

/// Sets `key` (dotted: `section.key`, `training.negatives.num_chunks`) to `value`. Every part but
/// the last must be a section of the configuration's schema, checked before anything is built:
/// a key of any length never nests the table deeper than the schema does (a submitted key of
/// thousands of parts once built a table too deep to serialise or drop on a thread's stack).
pub(super) fn set_dotted(
    table: &mut toml::Table,
    key: &str,
    value: toml::Value,
) -> Result<(), ConfigError> {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts
        .pop()
        .filter(|l| !l.is_empty())
        .ok_or_else(|| ConfigError(format!("--set: empty key in {key:?}")))?;
    let schema = toml::Table::try_from(Config::default()).expect("the defaults serialise");
    let mut section = &schema;
    for (i, p) in parts.iter().enumerate() {
        section = section
            .get(*p)
            .and_then(toml::Value::as_table)
            .ok_or_else(|| {
                let known: Vec<&str> = section
                    .iter()
                    .filter(|(_, v)| v.is_table())
                    .map(|(k, _)| k.as_str())
                    .collect();
                let path = parts[..=i].join(".");
                let known = if known.is_empty() {
                    format!("{} has no sections", parts[..i].join("."))
                } else {
                    format!("sections there: {}", known.join(", "))
                };
                // Quote at most the unknown part, not the whole (submitted) key.
                ConfigError(format!(
                    "--set: {}: not a section of the configuration ({known})",
                    shorten(&path)
                ))
            })?;
    }
    let mut t = table;
    for p in parts {
        t = t
            .entry(p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| ConfigError(format!("--set {key}: {p} is not a section")))?;
    }
    t.insert(last.to_owned(), value);
    Ok(())
}

/// `text`, cut to its first 80 characters with `…` when longer (for messages).
fn shorten(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}
