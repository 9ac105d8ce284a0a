//! Watchers of a job's events: a queue each, filled by the job without ever waiting (a watcher
//! [`BACKLOG`] events or [`BACKLOG_BYTES`] behind misses some), grown only as events come,
//! and taken off its job the moment its connection's watch ends, however it ends: a closed
//! watch holds nothing. An event is serialised once, and its bytes shared by every watcher.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Events kept for a slow watcher before it misses some (progress is sent again soon).
pub const BACKLOG: usize = 64;

/// Bytes of events kept for a slow watcher (a job's process may send events of up to
/// `channel::CONTROL_MAX` each).
pub const BACKLOG_BYTES: usize = 256 << 10;

/// An event, serialised: the body of the frame a watcher gets.
pub type Event = Arc<[u8]>;

/// One watcher's queue.
#[derive(Default)]
pub struct Watcher {
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    events: VecDeque<Event>,
    /// Bytes of `events`.
    bytes: usize,
    /// The job ended (or went back to the queue with a stopping daemon): nothing more comes.
    closed: bool,
}

/// What a watcher's wait found.
pub enum Next {
    /// An event.
    Event(Event),
    /// Nothing within the wait.
    Quiet,
    /// The job ended: nothing more comes.
    Closed,
}

impl Watcher {
    /// Queues `event` unless the backlog is full.
    pub fn push(&self, event: &Event) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.events.len() < BACKLOG && s.bytes + event.len() <= BACKLOG_BYTES && !s.closed {
            s.bytes += event.len();
            s.events.push_back(event.clone());
            self.ready.notify_one();
        }
    }

    /// Says nothing more comes.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.ready.notify_one();
    }

    /// The next event, waiting up to `wait`.
    pub fn next(&self, wait: Duration) -> Next {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (mut s, _) = self
            .ready
            .wait_timeout_while(s, wait, |s| s.events.is_empty() && !s.closed)
            .unwrap_or_else(|e| e.into_inner());
        match s.events.pop_front() {
            Some(event) => {
                s.bytes -= event.len();
                Next::Event(event)
            }
            None if s.closed => Next::Closed,
            None => Next::Quiet,
        }
    }
}

/// A job's watchers, with the ids their connections hold them by.
#[derive(Default)]
pub struct Watchers {
    next: u64,
    list: Vec<(u64, Arc<Watcher>)>,
}

impl Watchers {
    /// Adds a watcher; its id takes it off again.
    pub fn add(&mut self) -> (u64, Arc<Watcher>) {
        self.next += 1;
        let w = Arc::new(Watcher::default());
        self.list.push((self.next, w.clone()));
        (self.next, w)
    }

    /// Takes watcher `id` off.
    pub fn remove(&mut self, id: u64) {
        self.list.retain(|(i, _)| *i != id);
    }

    /// Sends `event` to every watcher.
    pub fn broadcast(&self, event: &Event) {
        for (_, w) in &self.list {
            w.push(event);
        }
    }

    /// Whether anyone watches.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Closes every watch (the job ended) and forgets them.
    pub fn close_all(&mut self) {
        for (_, w) in self.list.drain(..) {
            w.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watcher_gets_events_up_to_its_backlog_then_the_close() {
        let mut all = Watchers::default();
        let (id, w) = all.add();
        let event: Event = Arc::from(&b"e"[..]);
        for _ in 0..BACKLOG + 10 {
            all.broadcast(&event);
        }
        let mut got = 0;
        while let Next::Event(_) = w.next(Duration::ZERO) {
            got += 1;
        }
        assert_eq!(got, BACKLOG);
        // Large events: bounded by their bytes first.
        let large: Event = Arc::from(vec![0u8; 60 << 10]);
        for _ in 0..10 {
            all.broadcast(&large);
        }
        let mut got = 0;
        while let Next::Event(_) = w.next(Duration::ZERO) {
            got += 1;
        }
        assert_eq!(got, BACKLOG_BYTES / (60 << 10));
        assert!(matches!(w.next(Duration::from_millis(1)), Next::Quiet));
        all.close_all();
        assert!(matches!(w.next(Duration::from_secs(5)), Next::Closed));
        all.remove(id);
        assert!(all.is_empty());
    }
}
