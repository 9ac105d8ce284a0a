//! Which edge buckets some buffer state has already held together.

/// Symmetric N×N coverage matrix: bucket (a, b) is covered once a and b were co-resident.
#[derive(Clone)]
pub(crate) struct Cover {
    n: usize,
    covered: Vec<bool>,
    /// Covered buckets per row; rows equal columns since the matrix is symmetric.
    row: Vec<usize>,
    total: usize,
}

impl Cover {
    pub(crate) fn new(n: u32) -> Self {
        let n = n as usize;
        Cover {
            n,
            covered: vec![false; n * n],
            row: vec![0; n],
            total: 0,
        }
    }

    pub(crate) fn is(&self, a: u32, b: u32) -> bool {
        self.covered[a as usize * self.n + b as usize]
    }

    /// Marks bucket (a, b) and (b, a).
    fn mark(&mut self, a: u32, b: u32) {
        let (a, b) = (a as usize, b as usize);
        for (x, y) in [(a, b), (b, a)] {
            let cell = &mut self.covered[x * self.n + y];
            if !*cell {
                *cell = true;
                self.row[x] += 1;
                self.total += 1;
            }
        }
    }

    /// Marks every bucket between residents of `state`.
    pub(crate) fn mark_state(&mut self, state: &[u32]) {
        for (i, &a) in state.iter().enumerate() {
            for &b in &state[i..] {
                self.mark(a, b);
            }
        }
    }

    /// Buckets that loading `x` next to `others` would newly cover.
    pub(crate) fn gain(&self, x: u32, others: &[u32]) -> usize {
        let own = usize::from(!self.is(x, x));
        own + others.iter().filter(|&&o| o != x && !self.is(x, o)).count() * 2
    }

    pub(crate) fn row_full(&self, a: u32) -> bool {
        self.row[a as usize] == self.n
    }

    pub(crate) fn all(&self) -> bool {
        self.total == self.n * self.n
    }
}
