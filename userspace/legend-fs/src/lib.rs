//! Files and directories reached beneath an open directory, never through a symbolic link.
//!
//! A process that writes on someone else's behalf (legendd writes a job's run directory, which
//! sits in its submitter's directory) must not let that someone redirect its writes: a path
//! resolved again at every write can be swapped for a symbolic link between two writes. A
//! [`Dir`] is resolved once, when it is opened; every name under it is resolved from its
//! descriptor one component at a time with `O_NOFOLLOW`, and `..` and absolute names are
//! refused. Renaming or replacing the directory's path then changes nothing about where the
//! writes land, and no link planted inside it is followed. A file opened for writing must be a
//! regular file with a single name (a hard link to somebody else's file is refused) or a block
//! device; FIFOs and other special files are refused before they could block a reader.
//!
//! [`Guard`] is the caller's check of a directory it opens by path (legendd admits only its
//! job's submitter's directories). It runs on the opened descriptor, so it cannot be raced.
//!
//! Reading on someone's behalf has the mirror problem: the reader must not reach what that
//! someone could not. [`Dir::open_checked`] resolves a path one directory at a time from `/`,
//! asking a [`ReadCheck`] about each (search permission on the way, read at the end), and the
//! directory it returns asks the same about every directory and file opened beneath it.

mod made;

pub use made::MadeDirs;

use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, FcntlArg, OFlag, RenameFlags, fcntl, openat, renameat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, fsync, unlinkat};

/// An open directory; every name given to its methods is relative to it and resolved beneath
/// it without following symbolic links. Errors carry no path: callers name the file (see
/// [`Dir::join`]).
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
    /// Asked about everything opened beneath, when the directory was opened for a reader.
    check: Option<ReadCheck>,
    /// Whether `check` is asked about files opened to write too ([`Dir::open_checked`]), or
    /// only about reads and the directories on the way ([`Dir::reading_as`]).
    check_writes: bool,
    /// The largest text file [`Dir::read_to_string`] reads beneath ([`Dir::with_text_limit`]).
    text_limit: u64,
}

/// Whether a reader may use an opened file or directory (its metadata) for `want`: the
/// permission bits 4 (read), 2 (write), 1 (search), or a sum of them. Returns an error
/// (`PermissionDenied`) when it may not.
pub type ReadCheck = Arc<dyn Fn(&FileStat, u32) -> io::Result<()> + Send + Sync>;

impl std::fmt::Debug for Dir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dir")
            .field("path", &self.path)
            .field("checked", &self.check.is_some())
            .finish()
    }
}

/// How [`Dir::open_file`] opens a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read only.
    Read,
    /// Read and write a file that exists.
    ReadWrite,
    /// Read and write, creating the file when it is missing.
    ReadWriteCreate,
    /// Write a file that must not exist yet.
    CreateNew,
    /// Append, creating the file when it is missing.
    Append,
}

impl Access {
    fn flags(self) -> OFlag {
        match self {
            Access::Read => OFlag::O_RDONLY,
            Access::ReadWrite => OFlag::O_RDWR,
            Access::ReadWriteCreate => OFlag::O_RDWR | OFlag::O_CREAT,
            Access::CreateNew => OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
            Access::Append => OFlag::O_WRONLY | OFlag::O_APPEND | OFlag::O_CREAT,
        }
    }

    fn writes(self) -> bool {
        self != Access::Read
    }
}

/// A check of each directory a writer opens by path, made on the opened directory, and what
/// it does with a directory it makes there for someone.
pub trait Guard: Send + Sync {
    /// Refuses (with `PermissionDenied` and the reason) a directory the writer must not use.
    fn admit(&self, dir: &Dir) -> io::Result<()>;

    /// Called on a directory the writer has just made at someone's request (a run directory,
    /// an export's): the daemon hands it to its submitter at once, so that the same directory
    /// is theirs, and admitted, when a later job opens it again.
    fn adopt(&self, _dir: &Dir) -> io::Result<()> {
        Ok(())
    }

    /// How a reader on someone's behalf checks what it opens (see [`Dir::open_checked`]);
    /// `None`: it reads with its own permissions.
    fn read_check(&self) -> Option<ReadCheck> {
        None
    }
}

/// Admits every directory: a user's own process writing where the user asked.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unguarded;

impl Guard for Unguarded {
    fn admit(&self, _: &Dir) -> io::Result<()> {
        Ok(())
    }
}

/// The largest text file [`Dir::read_to_string`] reads (configuration, run records, metrics).
pub const TEXT_LIMIT: u64 = 64 << 20;

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn refused(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message.into())
}

/// Symbolic links [`Dir::open_checked`] follows in one path, as the kernel's limit.
const MAX_LINKS: usize = 40;

/// Pushes `path`'s names onto `left` so that they pop first to last; an absolute path starts
/// with an empty name (back to `/`), and `.` is left out (`..` is walked as a name).
fn push_names(left: &mut Vec<OsString>, path: &Path) {
    let mut names: Vec<OsString> = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir => names.push(OsString::new()),
            Component::Normal(n) => names.push(n.to_owned()),
            Component::ParentDir => names.push(OsString::from("..")),
            Component::CurDir | Component::Prefix(_) => {}
        }
    }
    left.extend(names.into_iter().rev());
}

/// The names of `rel`, which must stay beneath its directory.
fn names(rel: &Path) -> io::Result<Vec<&OsStr>> {
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => names.push(n),
            Component::CurDir => {}
            _ => {
                return Err(refused(format!(
                    "{}: names outside its directory (absolute or `..`)",
                    rel.display()
                )));
            }
        }
    }
    Ok(names)
}

/// The error of an `*at` call on `name` in `parent`: a symbolic link there is named as such.
fn at_error(parent: BorrowedFd<'_>, name: &OsStr, e: Errno) -> io::Error {
    if matches!(e, Errno::ELOOP | Errno::ENOTDIR)
        && fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .is_ok_and(|st| kind(&st) == SFlag::S_IFLNK)
    {
        return refused(
            "a symbolic link: not followed (files are reached beneath their directory only)",
        );
    }
    e.into()
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

/// Refuses to write anything but a regular file with one name, or a block device.
fn check_writable(st: &FileStat) -> io::Result<()> {
    match kind(st) {
        SFlag::S_IFREG if st.st_nlink > 1 => Err(refused(format!(
            "has {} names (hard links): a file that may also be someone else's is not written",
            st.st_nlink
        ))),
        SFlag::S_IFREG | SFlag::S_IFBLK => Ok(()),
        _ => Err(refused("not a regular file or block device")),
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Dir {
    /// Opens the directory `path` (symbolic links on the way are followed: the path is the
    /// caller's choice; what lies beneath is not).
    pub fn open(path: &Path) -> io::Result<Dir> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::open(path, flags, Mode::empty())?;
        Ok(Dir {
            fd,
            path: path.to_owned(),
            check: None,
            check_writes: false,
            text_limit: TEXT_LIMIT,
        })
    }

    /// Opens the directory `path` for a reader `check` speaks for, resolving it as the kernel
    /// would for that reader: from `/`, one name at a time, each directory checked for search
    /// before anything in it is looked up, each name opened with `O_NOFOLLOW`; a symbolic link
    /// met on the way is read (from its checked directory) and its target walked the same way.
    /// The last directory is checked for reading and search, and every directory and file
    /// later opened beneath the result is checked too. Nothing is looked up with the caller's
    /// own rights first, so an error tells the reader only what it could have found out itself
    /// (a name inside a directory it may not search is "permission denied", present or not),
    /// and a link swapped in midway leads nowhere the reader could not go.
    pub fn open_checked(path: &Path, check: ReadCheck) -> io::Result<Dir> {
        if !path.is_absolute() {
            return Err(refused(format!("{}: not an absolute path", path.display())));
        }
        let root = || nix::fcntl::open("/", dir_flags(), Mode::empty());
        let mut fd = root()?;
        // Names still to walk, the next last; links met push their targets' names.
        let mut left: Vec<OsString> = Vec::new();
        push_names(&mut left, path);
        let mut links = 0;
        while let Some(name) = left.pop() {
            if name.is_empty() {
                // A link's absolute target: from the top again.
                fd = root()?;
                continue;
            }
            check(&fstat(&fd)?, 1)?;
            match openat(&fd, name.as_os_str(), dir_flags(), Mode::empty()) {
                Ok(next) => fd = next,
                Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
                    let st = fstatat(&fd, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)?;
                    if kind(&st) != SFlag::S_IFLNK {
                        return Err(e.into());
                    }
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(Errno::ELOOP.into());
                    }
                    let target = nix::fcntl::readlinkat(&fd, name.as_os_str())?;
                    push_names(&mut left, Path::new(&target));
                }
                Err(e) => return Err(e.into()),
            }
        }
        check(&fstat(&fd)?, 5)?;
        Ok(Dir {
            fd,
            path: path.to_owned(),
            check: Some(check),
            check_writes: true,
            text_limit: TEXT_LIMIT,
        })
    }

    /// Opens the directory holding the file `path` (by its path, as [`Dir::open`]) and returns
    /// it with the file's name in it.
    pub fn open_parent(path: &Path) -> io::Result<(Dir, &Path)> {
        let name = path
            .file_name()
            .ok_or_else(|| refused(format!("{}: names no file", path.display())))?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        Ok((Dir::open(parent)?, Path::new(name)))
    }

    /// Opens the directory `path` and has `guard` admit it.
    pub fn open_guarded(path: &Path, guard: &dyn Guard) -> io::Result<Dir> {
        let dir = Dir::open(path)?;
        guard.admit(&dir)?;
        Ok(dir)
    }

    /// The same directory, whose reads beneath are checked by `check` from now on (the files
    /// read and the directories on the way; `None`: none): for a directory a [`Guard`] admitted
    /// for writing on someone's behalf, where a file (a hard link, say) need still not be one
    /// they could read. Writes stay the guard's business.
    pub fn reading_as(self, check: Option<ReadCheck>) -> Dir {
        Dir {
            check,
            check_writes: false,
            ..self
        }
    }

    /// The same directory, whose text files (and those of the directories opened beneath it)
    /// are read by [`Dir::read_to_string`] only up to `max` bytes: a reader holding many at
    /// once (a service, for its requests) bounds what each costs it.
    pub fn with_text_limit(self, max: u64) -> Dir {
        Dir {
            text_limit: max.min(TEXT_LIMIT),
            ..self
        }
    }

    /// The same directory, named `path` from now on (after a rename).
    pub fn with_path(self, path: PathBuf) -> Dir {
        Dir { path, ..self }
    }

    /// The path it was opened by (for messages: the directory may have moved since).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `rel` under [`Dir::path`], for messages.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.path.join(rel)
    }

    /// The directory's own metadata (owner, mode, inode), from its descriptor.
    pub fn metadata(&self) -> io::Result<Metadata> {
        File::from(self.fd.try_clone()?).metadata()
    }

    /// Another handle on the same directory.
    pub fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            path: self.path.clone(),
            check: self.check.clone(),
            check_writes: self.check_writes,
            text_limit: self.text_limit,
        })
    }

    /// Asks the read check (if any) about the opened `fd` for `want`.
    fn checked(&self, fd: &OwnedFd, want: u32) -> io::Result<()> {
        match &self.check {
            Some(check) => check(&fstat(fd)?, want),
            None => Ok(()),
        }
    }

    /// Opens the directories `names` one under the other; `None` for none (this one).
    fn walk(&self, names: &[&OsStr]) -> io::Result<Option<OwnedFd>> {
        let mut held: Option<OwnedFd> = None;
        for name in names {
            let base = held.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
            let next = openat(base, *name, dir_flags(), Mode::empty())
                .map_err(|e| at_error(base, name, e))?;
            self.checked(&next, 1)?;
            held = Some(next);
        }
        Ok(held)
    }

    /// The directory holding `rel`'s last name (`None`: this one), and that name.
    fn parent<'a>(&self, rel: &'a Path) -> io::Result<(Option<OwnedFd>, &'a OsStr)> {
        let names = names(rel)?;
        let (last, dirs) = names
            .split_last()
            .ok_or_else(|| refused(format!("{}: names no entry", rel.display())))?;
        Ok((self.walk(dirs)?, last))
    }

    fn base<'a>(&'a self, held: &'a Option<OwnedFd>) -> BorrowedFd<'a> {
        held.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd())
    }

    /// The directory `rel` beneath this one (`.` for another handle on this one).
    pub fn dir(&self, rel: impl AsRef<Path>) -> io::Result<Dir> {
        let rel = rel.as_ref();
        let fd = match self.walk(&names(rel)?)? {
            Some(fd) => fd,
            None => self.fd.try_clone()?,
        };
        self.checked(&fd, 5)?;
        Ok(Dir {
            fd,
            path: self.path.join(rel),
            check: self.check.clone(),
            check_writes: self.check_writes,
            text_limit: self.text_limit,
        })
    }

    /// Makes the directory `rel` (its parent must exist) and opens it.
    pub fn create_dir(&self, rel: impl AsRef<Path>) -> io::Result<Dir> {
        let rel = rel.as_ref();
        let (held, name) = self.parent(rel)?;
        let base = self.base(&held);
        mkdirat(base, name, Mode::from_bits_truncate(0o777))
            .map_err(|e| at_error(base, name, e))?;
        self.dir(rel)
    }

    /// Makes the directory `rel` and any missing parent, and opens it.
    pub fn create_dir_all(&self, rel: impl AsRef<Path>) -> io::Result<Dir> {
        let rel = rel.as_ref();
        let mut held: Option<OwnedFd> = None;
        for name in names(rel)? {
            let base = self.base(&held);
            match mkdirat(base, name, Mode::from_bits_truncate(0o777)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(at_error(base, name, e)),
            }
            let next = openat(base, name, dir_flags(), Mode::empty())
                .map_err(|e| at_error(base, name, e))?;
            held = Some(next);
        }
        Ok(Dir {
            fd: match held {
                Some(fd) => fd,
                None => self.fd.try_clone()?,
            },
            path: self.path.join(rel),
            check: self.check.clone(),
            check_writes: self.check_writes,
            text_limit: self.text_limit,
        })
    }

    /// The metadata of the entry `rel` itself (a link is not followed); `None` when absent.
    pub fn entry(&self, rel: impl AsRef<Path>) -> io::Result<Option<FileStat>> {
        let (held, name) = match self.parent(rel.as_ref()) {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        match fstatat(self.base(&held), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether `rel` exists (a link counts, whatever it points at).
    pub fn exists(&self, rel: impl AsRef<Path>) -> io::Result<bool> {
        Ok(self.entry(rel)?.is_some())
    }

    /// Whether `rel` is a regular file (not through a link).
    pub fn is_file(&self, rel: impl AsRef<Path>) -> io::Result<bool> {
        Ok(self
            .entry(rel)?
            .is_some_and(|st| kind(&st) == SFlag::S_IFREG))
    }

    /// The names in the directory `rel` (without `.` and `..`), sorted.
    pub fn entries(&self, rel: impl AsRef<Path>) -> io::Result<Vec<OsString>> {
        let mut names = names_in(&self.dir(rel)?.fd)?;
        names.sort();
        Ok(names)
    }

    /// Opens the file `rel` as `access` says. A file opened to write must be a regular file
    /// with one name or a block device; any file must be one of those two.
    pub fn open_file(&self, rel: impl AsRef<Path>, access: Access) -> io::Result<File> {
        self.open_with(rel.as_ref(), access, OFlag::empty())
    }

    /// [`Dir::open_file`] with `O_DIRECT` (the file system may refuse it: `EINVAL`).
    pub fn open_file_direct(&self, rel: impl AsRef<Path>, access: Access) -> io::Result<File> {
        self.open_with(rel.as_ref(), access, OFlag::O_DIRECT)
    }

    fn open_with(&self, rel: &Path, access: Access, extra: OFlag) -> io::Result<File> {
        let (held, name) = self.parent(rel)?;
        let base = self.base(&held);
        // Non-blocking until checked: opening a FIFO to read would wait for a writer.
        let flags =
            access.flags() | extra | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
        let fd = openat(base, name, flags, Mode::from_bits_truncate(0o666))
            .map_err(|e| at_error(base, name, e))?;
        let st = fstat(&fd)?;
        match &self.check {
            Some(check) if !access.writes() => check(&st, 4)?,
            Some(check) if self.check_writes => check(&st, 6)?,
            _ => {}
        }
        check_writable(&st).or_else(|e| {
            let readable = matches!(kind(&st), SFlag::S_IFREG | SFlag::S_IFBLK);
            if access.writes() || !readable {
                Err(e)
            } else {
                Ok(())
            }
        })?;
        let without_nonblock =
            OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?).difference(OFlag::O_NONBLOCK);
        fcntl(&fd, FcntlArg::F_SETFL(without_nonblock))?;
        Ok(File::from(fd))
    }

    /// The contents of the file `rel`.
    pub fn read(&self, rel: impl AsRef<Path>) -> io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.open_file(rel, Access::Read)?.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    /// The contents of the text file `rel`: a record, at most [`TEXT_LIMIT`] bytes, or the
    /// directory's own limit ([`Dir::with_text_limit`]). A larger file, even a sparse one, is
    /// refused rather than read into memory, and so is anything but a regular file.
    pub fn read_to_string(&self, rel: impl AsRef<Path>) -> io::Result<String> {
        let file = self.open_file(rel, Access::Read)?;
        let limit = self.text_limit;
        let too_big = || {
            refused(if limit >= 1 << 20 {
                format!("larger than {} MiB: not a text record", limit >> 20)
            } else {
                format!("larger than {} KiB: not a text record", limit >> 10)
            })
        };
        let m = file.metadata()?;
        if !m.is_file() {
            return Err(refused("not a regular file"));
        }
        if m.len() > limit {
            return Err(too_big());
        }
        let mut text = String::new();
        file.take(limit + 1).read_to_string(&mut text)?;
        if text.len() as u64 > limit {
            return Err(too_big());
        }
        Ok(text)
    }

    /// Renames `from` to `to` (both beneath this directory; `to` is replaced if it exists).
    pub fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> io::Result<()> {
        self.rename_with(from.as_ref(), to.as_ref(), RenameFlags::empty())
    }

    /// Swaps `a` and `b` (both beneath this directory, both existing, of any kind) in one step
    /// (`renameat2` with `RENAME_EXCHANGE`): each name always names one of the two, so a
    /// directory assembled under a temporary name replaces a whole one at once, and the old one
    /// is then at the temporary name.
    pub fn exchange(&self, a: impl AsRef<Path>, b: impl AsRef<Path>) -> io::Result<()> {
        self.rename_with(a.as_ref(), b.as_ref(), RenameFlags::RENAME_EXCHANGE)
    }

    fn rename_with(&self, from: &Path, to: &Path, flags: RenameFlags) -> io::Result<()> {
        let (from_held, from_name) = self.parent(from)?;
        let (to_held, to_name) = self.parent(to)?;
        renameat2(
            self.base(&from_held),
            from_name,
            self.base(&to_held),
            to_name,
            flags,
        )?;
        Ok(())
    }

    /// Removes the file (or link) `rel`.
    pub fn remove_file(&self, rel: impl AsRef<Path>) -> io::Result<()> {
        let (held, name) = self.parent(rel.as_ref())?;
        unlinkat(self.base(&held), name, UnlinkatFlags::NoRemoveDir)?;
        Ok(())
    }

    /// Removes `rel` and, if it is a directory, everything in it; links are removed, never
    /// followed.
    pub fn remove_all(&self, rel: impl AsRef<Path>) -> io::Result<()> {
        let (held, name) = self.parent(rel.as_ref())?;
        remove_entry(self.base(&held), name)
    }

    /// Removes `rel` as [`Dir::remove_all`] does, if it is there (what a crash left behind).
    pub fn clear(&self, rel: impl AsRef<Path>) -> io::Result<()> {
        match self.remove_all(rel) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Writes `bytes` to `rel` through a synced temporary file (`rel` with `.tmp` added) and a
    /// rename, then syncs the directory: `rel` holds the old bytes or the new, never a part.
    pub fn write_atomically(&self, rel: impl AsRef<Path>, bytes: &[u8]) -> io::Result<()> {
        let rel = rel.as_ref();
        let mut tmp_name = rel.as_os_str().to_owned();
        tmp_name.push(".tmp");
        let tmp = Path::new(&tmp_name);
        self.clear(tmp)?;
        let mut f = self.open_file(tmp, Access::CreateNew)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        self.rename(tmp, rel)?;
        let (held, _) = self.parent(rel)?;
        fsync(self.base(&held))?;
        Ok(())
    }

    /// Flushes the directory's entries (after a rename or a new file in it).
    pub fn sync(&self) -> io::Result<()> {
        Ok(fsync(&self.fd)?)
    }
}

/// Who, besides this process's own user and root, could change the contents of the open file
/// `file` while this process reads it: `None` when no one can (the file is this user's or
/// root's, and neither its group nor others may write it; an ACL's entries are bounded by its
/// mask, which the group bits are; and it is not on a FUSE file system, whose server, which
/// may be anyone's, says what it holds and who owns it), else who, in words.
///
/// A file no one else can change may be mapped into a process that others rely on (legendd's
/// serve job answers its submitter's group): a change under the mapping could then come only
/// from the user who controls the process anyway (they may trace it and write its memory) or
/// from root. A file someone else could rewrite or truncate is read into the process instead,
/// so that what was checked when it was read is what is used.
pub fn writable_by_others(file: &File) -> io::Result<Option<String>> {
    use nix::sys::statfs::{FUSE_SUPER_MAGIC, fstatfs};
    if fstatfs(file)?.filesystem_type() == FUSE_SUPER_MAGIC {
        return Ok(Some(
            "on a FUSE file system (its server says what the file holds)".into(),
        ));
    }
    let st = fstat(file)?;
    let me = nix::unistd::geteuid().as_raw();
    if st.st_uid != me && st.st_uid != 0 {
        return Ok(Some(format!(
            "owned by uid {} (this process runs as uid {me})",
            st.st_uid
        )));
    }
    let mode = st.st_mode & 0o7777;
    Ok((mode & 0o022 != 0).then(|| {
        let who = match (mode & 0o020 != 0, mode & 0o002 != 0) {
            (true, true) => "its group and others",
            (true, false) => "its group",
            _ => "others",
        };
        format!("writable by {who} (mode {mode:o})")
    }))
}

/// Tells the kernel that `len` bytes of `file` from `offset` will be read soon
/// (`POSIX_FADV_WILLNEED`): a cold file's pages are then read while the caller is still busy
/// with the bytes before them. Advice only: a kernel that declines it changes nothing; `len` 0
/// asks for nothing (not, as the call itself reads it, for the rest of the file).
pub fn will_read(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    if len == 0 {
        return;
    }
    let _ = nix::fcntl::posix_fadvise(
        file,
        offset,
        len,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
    );
}

/// The names in the directory `fd` (without `.` and `..`), unsorted.
fn names_in(fd: &OwnedFd) -> io::Result<Vec<OsString>> {
    let mut stream = nix::dir::Dir::from_fd(fd.try_clone()?)?;
    let mut names = Vec::new();
    for entry in stream.iter() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(OsStr::from_bytes(&name).to_owned());
        }
    }
    Ok(names)
}

/// Removes `name` in `parent` and, if it is a directory, everything in it, depth first with a
/// stack of its own rather than recursion: a tree nested deeper than a thread's stack (which
/// anyone who may write a directory can make) ends in an error (no descriptors left), not in a
/// crash of the process.
fn remove_entry(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    let is_dir =
        |at: BorrowedFd<'_>, name: &OsStr| match fstatat(at, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(kind(&st) == SFlag::S_IFDIR)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(io::Error::from(e)),
        };
    match is_dir(parent, name)? {
        None => return Err(io::ErrorKind::NotFound.into()),
        Some(false) => return Ok(unlinkat(parent, name, UnlinkatFlags::NoRemoveDir)?),
        Some(true) => {}
    }
    // Each level: the open directory, its name in the level above, the names left in it.
    let top = openat(parent, name, dir_flags(), Mode::empty())?;
    let left = names_in(&top)?;
    let mut stack: Vec<(OwnedFd, OsString, Vec<OsString>)> = vec![(top, name.to_owned(), left)];
    while let Some((fd, _, left)) = stack.last_mut() {
        let Some(child) = left.pop() else {
            let (_, own, _) = stack.pop().expect("a level");
            let above = stack.last().map_or(parent, |(fd, _, _)| fd.as_fd());
            unlinkat(above, own.as_os_str(), UnlinkatFlags::RemoveDir)?;
            continue;
        };
        match is_dir(fd.as_fd(), &child)? {
            None => {}
            Some(false) => unlinkat(fd.as_fd(), child.as_os_str(), UnlinkatFlags::NoRemoveDir)?,
            Some(true) => {
                let sub = openat(fd.as_fd(), child.as_os_str(), dir_flags(), Mode::empty())?;
                let left = names_in(&sub)?;
                stack.push((sub, child, left));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, symlink};

    use super::*;

    fn setup() -> (tempfile::TempDir, Dir) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        (tmp, dir)
    }

    #[test]
    fn writes_land_in_the_opened_directory_even_after_its_path_is_swapped_for_a_link() {
        let (tmp, _) = setup();
        let run = tmp.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let dir = Dir::open(&run).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::rename(&run, tmp.path().join("moved")).unwrap();
        symlink(&elsewhere, &run).unwrap();
        dir.write_atomically("run.toml", b"x = 1\n").unwrap();
        dir.create_dir_all("checkpoints/epoch-1").unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("moved/run.toml")).unwrap(),
            b"x = 1\n"
        );
        assert!(tmp.path().join("moved/checkpoints/epoch-1").is_dir());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    }

    #[test]
    fn links_inside_are_never_followed() {
        let (tmp, dir) = setup();
        let victim = tmp.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("f"), b"keep").unwrap();
        symlink(&victim, tmp.path().join("sub")).unwrap();
        symlink(victim.join("f"), tmp.path().join("metrics.jsonl")).unwrap();
        for e in [
            dir.open_file("metrics.jsonl", Access::Append).unwrap_err(),
            dir.open_file("metrics.jsonl", Access::Read).unwrap_err(),
            dir.open_file("sub/f", Access::ReadWrite).unwrap_err(),
            dir.create_dir_all("sub/x").unwrap_err(),
            dir.write_atomically("sub/f", b"no").unwrap_err(),
        ] {
            assert!(e.to_string().contains("symbolic link"), "{e}");
        }
        // A link in place of the temporary or the target is replaced, not written through.
        dir.write_atomically("metrics.jsonl", b"mine").unwrap();
        assert_eq!(std::fs::read(victim.join("f")).unwrap(), b"keep");
        assert_eq!(
            std::fs::read(tmp.path().join("metrics.jsonl")).unwrap(),
            b"mine"
        );
        // Removing a tree removes a link in it, not what it points at.
        dir.remove_all("sub").unwrap();
        assert!(victim.join("f").exists());
    }

    #[test]
    fn an_exchange_swaps_two_directories_at_once() {
        let (tmp, dir) = setup();
        dir.create_dir("old")
            .unwrap()
            .write_atomically("f", b"old")
            .unwrap();
        dir.create_dir("new")
            .unwrap()
            .write_atomically("f", b"new")
            .unwrap();
        dir.exchange("new", "old").unwrap();
        assert_eq!(std::fs::read(tmp.path().join("old/f")).unwrap(), b"new");
        assert_eq!(std::fs::read(tmp.path().join("new/f")).unwrap(), b"old");
        let e = dir.exchange("new", "missing").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn names_outside_the_directory_are_refused() {
        let (_tmp, dir) = setup();
        for rel in ["../x", "/etc/passwd", "a/../../x", ""] {
            assert!(dir.open_file(rel, Access::Read).is_err(), "{rel}");
        }
        assert!(dir.dir("..").is_err());
    }

    #[test]
    fn hard_links_and_special_files_are_not_written() {
        let (tmp, dir) = setup();
        std::fs::write(tmp.path().join("a"), b"keep").unwrap();
        std::fs::hard_link(tmp.path().join("a"), tmp.path().join("b")).unwrap();
        let e = dir.open_file("b", Access::Append).unwrap_err();
        assert!(e.to_string().contains("2 names"), "{e}");
        // Reading one is fine: it harms nobody.
        assert_eq!(dir.read("b").unwrap(), b"keep");
        nix::unistd::mkfifo(&tmp.path().join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        // Opening a FIFO to read would block without O_NONBLOCK; it is refused instead.
        let e = dir.read("fifo").unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = dir.open_file("", Access::Read).unwrap_err();
        assert!(e.to_string().contains("names no entry"), "{e}");
    }

    #[test]
    fn files_round_trip_and_trees_go() {
        let (tmp, dir) = setup();
        let sub = dir.create_dir_all("a/b").unwrap();
        sub.write_atomically("t", b"1").unwrap();
        assert_eq!(dir.read_to_string("a/b/t").unwrap(), "1");
        assert!(dir.is_file("a/b/t").unwrap());
        assert!(!dir.exists("a/b/nope").unwrap());
        assert!(!dir.exists("nope/deeper").unwrap());
        let mut f = dir.open_file("a/new", Access::CreateNew).unwrap();
        f.write_all(b"n").unwrap();
        assert!(dir.open_file("a/new", Access::CreateNew).is_err());
        dir.rename("a/new", "a/b/renamed").unwrap();
        assert_eq!(
            dir.entries("a/b").unwrap(),
            vec![OsString::from("renamed"), OsString::from("t")]
        );
        dir.remove_all("a").unwrap();
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        assert_eq!(
            dir.remove_all("a").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn a_checked_directory_asks_about_every_step_and_every_file() {
        let (tmp, _) = setup();
        let ds = tmp.path().join("a/ds");
        std::fs::create_dir_all(ds.join("sub")).unwrap();
        std::fs::write(ds.join("f"), b"data").unwrap();
        std::fs::write(ds.join("sub/g"), b"more").unwrap();
        symlink(&ds, tmp.path().join("link")).unwrap();
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        // A reader who may not search `a`, read `f` or enter `sub`.
        let refused = [
            ino(&tmp.path().join("a")),
            ino(&ds.join("f")),
            ino(&ds.join("sub")),
        ];
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let check: ReadCheck = Arc::new(move |st: &FileStat, want: u32| {
            log.lock().unwrap().push((st.st_ino, want));
            if refused.contains(&st.st_ino) {
                Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "not theirs",
                ))
            } else {
                Ok(())
            }
        });
        // Through the link too: the resolved path's directories are the ones checked.
        for path in [ds.clone(), tmp.path().join("link")] {
            let e = Dir::open_checked(&path, check.clone()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        }
        let only_files = [ino(&ds.join("f")), ino(&ds.join("sub"))];
        let check: ReadCheck = Arc::new(move |st: &FileStat, _| {
            if only_files.contains(&st.st_ino) {
                Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "not theirs",
                ))
            } else {
                Ok(())
            }
        });
        let dir = Dir::open_checked(&tmp.path().join("link"), check).unwrap();
        assert_eq!(
            dir.read("f").unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert_eq!(
            dir.read("sub/g").unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert_eq!(
            dir.dir("sub").unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert_eq!(
            dir.entries(".").unwrap().len(),
            2,
            "the directory itself may be listed"
        );
        let asked = seen.lock().unwrap();
        assert!(
            asked.contains(&(ino(Path::new("/")), 1)),
            "the walk starts at /"
        );
    }

    #[test]
    fn a_checked_walk_tells_nothing_about_what_is_behind_a_closed_directory() {
        let (tmp, _) = setup();
        let closed = tmp.path().join("closed");
        std::fs::create_dir_all(closed.join("there")).unwrap();
        std::fs::create_dir_all(tmp.path().join("open/ds")).unwrap();
        let closed_ino = std::fs::metadata(&closed).unwrap().ino();
        let check: ReadCheck = Arc::new(move |st: &FileStat, _| {
            if st.st_ino == closed_ino {
                Err(io::Error::new(io::ErrorKind::PermissionDenied, "closed"))
            } else {
                Ok(())
            }
        });
        // Present or absent, behind a link or not: the same answer.
        symlink(closed.join("there"), tmp.path().join("to-there")).unwrap();
        symlink("../closed/there", tmp.path().join("open/relative")).unwrap();
        for path in [
            closed.join("there"),
            closed.join("absent"),
            tmp.path().join("to-there"),
            tmp.path().join("open/relative"),
            closed.join("absent/../.."),
        ] {
            let e = Dir::open_checked(&path, check.clone()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{path:?}: {e}");
        }
        // Links the reader may follow are followed, relative ones from their directory.
        symlink("ds", tmp.path().join("open/to-ds")).unwrap();
        symlink(tmp.path().join("open/to-ds"), tmp.path().join("chain")).unwrap();
        let dir = Dir::open_checked(&tmp.path().join("chain"), check.clone()).unwrap();
        assert_eq!(
            dir.metadata().unwrap().ino(),
            std::fs::metadata(tmp.path().join("open/ds")).unwrap().ino()
        );
        symlink("loop", tmp.path().join("loop")).unwrap();
        let e = Dir::open_checked(&tmp.path().join("loop"), check.clone()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(Errno::ELOOP as i32), "{e}");
        assert!(Dir::open_checked(Path::new("relative"), check).is_err());
    }

    #[test]
    fn a_directory_read_as_someone_checks_reads_and_leaves_writes_alone() {
        let (tmp, dir) = setup();
        std::fs::write(tmp.path().join("theirs"), b"secret").unwrap();
        std::fs::write(tmp.path().join("mine"), b"open").unwrap();
        let theirs = std::fs::metadata(tmp.path().join("theirs")).unwrap().ino();
        let check: ReadCheck = Arc::new(move |st: &FileStat, _| {
            if st.st_ino == theirs {
                Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "not theirs",
                ))
            } else {
                Ok(())
            }
        });
        let dir = dir.reading_as(Some(check));
        assert_eq!(
            dir.read("theirs").unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert_eq!(dir.read("mine").unwrap(), b"open");
        dir.open_file("theirs", Access::Append).unwrap();
        dir.write_atomically("new", b"n").unwrap();
        assert_eq!(dir.dir(".").unwrap().read("new").unwrap(), b"n");
        assert_eq!(dir.reading_as(None).read("theirs").unwrap(), b"secret");
    }

    #[test]
    fn a_tree_deeper_than_a_small_stack_is_removed_without_recursion() {
        let (tmp, dir) = setup();
        let mut at = dir.create_dir("deep").unwrap().fd;
        for _ in 0..400 {
            mkdirat(&at, "d", Mode::from_bits_truncate(0o755)).unwrap();
            let file = OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC;
            drop(openat(&at, "f", file, Mode::from_bits_truncate(0o644)).unwrap());
            at = openat(&at, "d", dir_flags(), Mode::empty()).unwrap();
        }
        // On a thread with a 64 KiB stack, where a recursion 400 levels deep would not fit.
        let handle = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || dir.remove_all("deep"))
            .unwrap();
        handle.join().unwrap().unwrap();
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_huge_text_file_is_refused_not_read() {
        let (tmp, dir) = setup();
        let f = std::fs::File::create(tmp.path().join("run.toml")).unwrap();
        f.set_len(TEXT_LIMIT + 1).unwrap();
        let e = dir.read_to_string("run.toml").unwrap_err();
        assert!(e.to_string().contains("not a text record"), "{e}");
        f.set_len(10).unwrap();
        assert_eq!(dir.read_to_string("run.toml").unwrap().len(), 10);
    }

    #[test]
    fn a_guard_sees_the_opened_directory() {
        struct OnlyEmpty;
        impl Guard for OnlyEmpty {
            fn admit(&self, dir: &Dir) -> io::Result<()> {
                if dir.entries(".")?.is_empty() {
                    Ok(())
                } else {
                    Err(io::Error::new(io::ErrorKind::PermissionDenied, "not empty"))
                }
            }
        }
        let (tmp, _) = setup();
        assert!(Dir::open_guarded(tmp.path(), &OnlyEmpty).is_ok());
        std::fs::write(tmp.path().join("x"), b"").unwrap();
        let e = Dir::open_guarded(tmp.path(), &OnlyEmpty).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn a_file_only_its_user_or_root_can_change_is_told_apart_from_one_others_can() {
        use std::os::unix::fs::PermissionsExt;
        let (tmp, _) = setup();
        let path = tmp.path().join("entities.bin");
        std::fs::write(&path, b"rows").unwrap();
        let why = |mode: u32| {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            writable_by_others(&File::open(&path).unwrap()).unwrap()
        };
        assert_eq!(why(0o644), None);
        assert_eq!(why(0o600), None);
        assert_eq!(why(0o444), None);
        assert_eq!(why(0o664).unwrap(), "writable by its group (mode 664)");
        assert_eq!(why(0o646).unwrap(), "writable by others (mode 646)");
        assert_eq!(
            why(0o666).unwrap(),
            "writable by its group and others (mode 666)"
        );
        // Another user's file (only root can give one away here), however its mode.
        if nix::unistd::geteuid().is_root() {
            let other = nix::unistd::Uid::from_raw(4321);
            nix::unistd::chown(&path, Some(other), None).unwrap();
            assert_eq!(
                why(0o644).unwrap(),
                "owned by uid 4321 (this process runs as uid 0)"
            );
        }
    }
}
