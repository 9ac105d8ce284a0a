//! The unit of work a plan schedules.

/// An edge bucket `[source partition, destination partition]`.
pub type Bucket = [u32; 2];
