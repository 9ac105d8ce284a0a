//! Delimited edge lists: delimiter detection, column orders, gzip.

use crate::error::RecordError;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{DatasetError, IoContext, Result};

/// Column order of a delimited edge list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Columns {
    /// head, relation, tail (also spelled `srd`: source, relation, destination).
    #[default]
    Hrt,
    /// head, tail, relation.
    Htr,
    /// source, destination: graphs without relation types.
    Sd,
}

impl Columns {
    /// Number of columns a line must have.
    pub fn width(self) -> usize {
        match self {
            Columns::Hrt | Columns::Htr => 3,
            Columns::Sd => 2,
        }
    }

    /// The positions of (head, relation, tail) in a line; relation is `None` for [`Columns::Sd`].
    fn positions(self) -> (usize, Option<usize>, usize) {
        match self {
            Columns::Hrt => (0, Some(1), 2),
            Columns::Htr => (0, Some(2), 1),
            Columns::Sd => (0, None, 1),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Columns::Hrt => "hrt",
            Columns::Htr => "htr",
            Columns::Sd => "sd",
        }
    }
}

impl FromStr for Columns {
    type Err = legend_model::UnknownName;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "hrt" | "srd" => Ok(Columns::Hrt),
            "htr" => Ok(Columns::Htr),
            "sd" => Ok(Columns::Sd),
            _ => Err(legend_model::UnknownName::new(
                "column order",
                s,
                "expected hrt, htr, srd or sd",
            )),
        }
    }
}

/// How fields of a line are separated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delimiter {
    /// Exactly one byte separates fields; two in a row mean an empty field.
    Byte(u8),
    /// Any run of spaces and tabs separates fields.
    Whitespace,
}

impl Delimiter {
    /// Guesses the delimiter from a data line: tab, else comma, else whitespace.
    pub fn detect(line: &[u8]) -> Delimiter {
        if line.contains(&b'\t') {
            Delimiter::Byte(b'\t')
        } else if line.contains(&b',') {
            Delimiter::Byte(b',')
        } else {
            Delimiter::Whitespace
        }
    }
}

impl FromStr for Delimiter {
    type Err = legend_model::UnknownName;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "tab" | "\\t" | "\t" => Ok(Delimiter::Byte(b'\t')),
            "comma" | "," => Ok(Delimiter::Byte(b',')),
            "space" | "whitespace" => Ok(Delimiter::Whitespace),
            _ if s.len() == 1 && s.is_ascii() => Ok(Delimiter::Byte(s.as_bytes()[0])),
            _ => Err(legend_model::UnknownName::new(
                "delimiter",
                s,
                "expected tab, comma, whitespace or a single ASCII character",
            )),
        }
    }
}

/// One parsed edge: labels of head, relation (if any) and tail, borrowed from the line.
pub(crate) struct Fields<'a> {
    pub head: &'a [u8],
    pub rel: Option<&'a [u8]>,
    pub tail: &'a [u8],
}

/// Splits `line` (without its line terminator) into the columns of `columns`.
pub(crate) fn parse_fields(
    line: &[u8],
    delimiter: Delimiter,
    columns: Columns,
) -> std::result::Result<Fields<'_>, RecordError> {
    let width = columns.width();
    let mut fields: [&[u8]; 3] = [&[]; 3];
    let mut count = 0usize;
    let pieces: Box<dyn Iterator<Item = &[u8]>> = match delimiter {
        Delimiter::Byte(b) => Box::new(line.split(move |&c| c == b)),
        Delimiter::Whitespace => Box::new(
            line.split(|&c| c == b' ' || c == b'\t')
                .filter(|f| !f.is_empty()),
        ),
    };
    for field in pieces {
        if count < width {
            fields[count] = field.trim_ascii();
        }
        count += 1;
    }
    if count != width {
        let what = if count < width {
            "missing column"
        } else {
            "wrong column count"
        };
        return Err(RecordError::Columns {
            what,
            width,
            columns: columns.name(),
            count,
        });
    }
    if let Some(i) = fields[..width].iter().position(|f| f.is_empty()) {
        return Err(RecordError::EmptyField(i + 1));
    }
    let (h, r, t) = columns.positions();
    Ok(Fields {
        head: fields[h],
        rel: r.map(|r| fields[r]),
        tail: fields[t],
    })
}

/// A line reader over a plain or gzip-compressed file that tracks line numbers and the
/// compressed bytes consumed (for progress).
pub(crate) struct LineReader {
    path: PathBuf,
    inner: Box<dyn BufRead + Send>,
    line: u64,
    consumed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Counts bytes read from the underlying file.
struct Counting<R> {
    inner: R,
    consumed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.consumed
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}

impl LineReader {
    /// Opens `path`; gzip is recognised by its magic bytes, whatever the file name.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).at(path)?;
        let mut magic = [0u8; 2];
        let n = read_up_to(&mut file, &mut magic).at(path)?;
        let gz = n == 2 && magic == [0x1f, 0x8b];
        let file = File::open(path).at(path)?;
        let consumed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counting = Counting {
            inner: file,
            consumed: consumed.clone(),
        };
        let inner: Box<dyn BufRead + Send> = if gz {
            let decoder =
                flate2::read::MultiGzDecoder::new(BufReader::with_capacity(1 << 16, counting));
            Box::new(BufReader::with_capacity(1 << 16, decoder))
        } else {
            Box::new(BufReader::with_capacity(1 << 16, counting))
        };
        Ok(LineReader {
            path: path.to_owned(),
            inner,
            line: 0,
            consumed,
        })
    }

    /// Compressed bytes consumed so far.
    pub fn consumed(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.consumed.clone()
    }

    /// Reads the next data line into `buf` (terminator stripped), skipping blank lines and
    /// `#` comments. Returns `None` at the end of the file.
    pub fn next_data_line(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>> {
        loop {
            buf.clear();
            let n = self.inner.read_until(b'\n', buf).map_err(|e| {
                let message = if e.kind() == io::ErrorKind::InvalidInput
                    || e.kind() == io::ErrorKind::InvalidData
                {
                    format!("unreadable (corrupt gzip?): {e}")
                } else {
                    e.to_string()
                };
                DatasetError::Parse {
                    path: self.path.clone(),
                    line: self.line + 1,
                    message,
                }
            })?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            while matches!(buf.last(), Some(b'\n' | b'\r')) {
                buf.pop();
            }
            let content = buf.trim_ascii_start();
            if content.is_empty() || content[0] == b'#' {
                continue;
            }
            return Ok(Some(self.line));
        }
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(
        line: &str,
        d: Delimiter,
        c: Columns,
    ) -> std::result::Result<(String, Option<String>, String), String> {
        let f = parse_fields(line.as_bytes(), d, c).map_err(|e| e.to_string())?;
        let s = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
        Ok((s(f.head), f.rel.map(s), s(f.tail)))
    }

    #[test]
    fn column_orders() {
        let tab = Delimiter::Byte(b'\t');
        assert_eq!(
            parse("a\tr\tb", tab, Columns::Hrt).unwrap(),
            ("a".into(), Some("r".into()), "b".into())
        );
        assert_eq!(
            parse("a\tb\tr", tab, Columns::Htr).unwrap(),
            ("a".into(), Some("r".into()), "b".into())
        );
        assert_eq!(
            parse("a\tb", tab, Columns::Sd).unwrap(),
            ("a".into(), None, "b".into())
        );
        assert_eq!(
            parse("  a   r \t b ", Delimiter::Whitespace, Columns::Hrt).unwrap(),
            ("a".into(), Some("r".into()), "b".into())
        );
    }

    #[test]
    fn bad_lines_are_named() {
        let tab = Delimiter::Byte(b'\t');
        assert!(
            parse("a\tr", tab, Columns::Hrt)
                .unwrap_err()
                .contains("missing column")
        );
        assert!(
            parse("a\tr\tb\tc", tab, Columns::Hrt)
                .unwrap_err()
                .contains("wrong column count")
        );
        assert!(
            parse("a\t\tb", tab, Columns::Hrt)
                .unwrap_err()
                .contains("empty field in column 2")
        );
        assert!(
            parse("a\t \tb", tab, Columns::Hrt)
                .unwrap_err()
                .contains("empty field in column 2")
        );
    }

    #[test]
    fn delimiter_detection_and_names() {
        assert_eq!(Delimiter::detect(b"a\tb,c"), Delimiter::Byte(b'\t'));
        assert_eq!(Delimiter::detect(b"a,b,c"), Delimiter::Byte(b','));
        assert_eq!(Delimiter::detect(b"a b c"), Delimiter::Whitespace);
        assert_eq!("tab".parse::<Delimiter>().unwrap(), Delimiter::Byte(b'\t'));
        assert_eq!(";".parse::<Delimiter>().unwrap(), Delimiter::Byte(b';'));
        assert!("::".parse::<Delimiter>().is_err());
        assert_eq!("srd".parse::<Columns>().unwrap(), Columns::Hrt);
        assert!("rht".parse::<Columns>().is_err());
    }
}
