//! What the proxy's tests share: page-aligned host memory, a queue pair with a data buffer
//! mapped through the proxy, and a small deterministic random source.
#![allow(dead_code)] // each test file uses its own part

use std::time::{Duration, Instant};

use legend_nvme::Controller;
use legend_nvme_protocol::{Opcode, QueuePair, Sqe, Status, prp};
use legend_nvme_proxy::Proxy;

pub const PAGE: usize = 4096;

/// Page-aligned zeroed host memory.
pub struct Mem(Vec<u8>, usize);

impl Mem {
    pub fn new(len: usize) -> Mem {
        let v = vec![0u8; len + PAGE];
        let off = v.as_ptr().align_offset(PAGE);
        Mem(v, off)
    }
    pub fn ptr(&mut self) -> *mut u8 {
        // SAFETY: `off < PAGE`, inside the vector.
        unsafe { self.0.as_mut_ptr().add(self.1) }
    }
    pub fn bytes(&mut self, len: usize) -> &mut [u8] {
        let off = self.1;
        &mut self.0[off..off + len]
    }
}

/// A queue pair of `depth` entries in memory mapped through `proxy`, with a data buffer of
/// `data` bytes and a PRP list page.
pub struct Fixture {
    _qmem: Mem,
    pub data: Mem,
    pub data_bus: Vec<u64>,
    list: *mut u64,
    list_bus: u64,
    pub qp: QueuePair,
    _db: legend_nvme::Doorbells,
    handles: [u32; 2],
}

impl Fixture {
    pub fn new(proxy: &Proxy, qid: u32, depth: u16, data: usize) -> Fixture {
        let mut qmem = Mem::new(3 * PAGE);
        let mut dmem = Mem::new(data);
        // SAFETY: both stay allocated (in the fixture) for as long as the proxy uses them.
        let (qmap, dmap) = unsafe {
            (
                proxy.map_host(qmem.ptr(), 3 * PAGE).unwrap(),
                proxy.map_host(dmem.ptr(), data).unwrap(),
            )
        };
        let q = proxy
            .create_queue_pair(legend_nvme::uapi::QueuePairArgs {
                qid,
                depth: u32::from(depth),
                sq_handle: qmap.handle,
                cq_handle: qmap.handle,
                sq_offset: 0,
                cq_offset: PAGE as u64,
                ..Default::default()
            })
            .unwrap();
        let db = proxy.doorbells().unwrap();
        // SAFETY: the rings lie in `qmem`, the doorbells in `db`, both kept by the fixture.
        let qp = unsafe {
            QueuePair::new(
                depth,
                qmem.ptr().cast(),
                qmem.ptr().add(PAGE).cast(),
                db.register(q.sq_doorbell),
                db.register(q.cq_doorbell),
            )
        };
        // SAFETY: the third page of the queue memory.
        let list = unsafe { qmem.ptr().add(2 * PAGE).cast::<u64>() };
        Fixture {
            list,
            list_bus: qmap.bus(2 * PAGE),
            _qmem: qmem,
            data: dmem,
            data_bus: dmap.bus_addrs,
            qp,
            _db: db,
            handles: [qmap.handle, dmap.handle],
        }
    }

    pub fn prps(&self, offset: usize, len: u64) -> prp::Prp {
        // SAFETY: one page of list entries in the fixture's queue memory.
        let list = unsafe { std::slice::from_raw_parts_mut(self.list, PAGE / 8) };
        let first = offset / PAGE;
        prp::build(
            (offset % PAGE) as u64,
            len,
            |i| self.data_bus[first + i],
            list,
            self.list_bus,
        )
        .unwrap()
    }

    /// Submits and waits (at most `timeout`) for one command.
    pub fn run(&mut self, sqe: Sqe, timeout: Duration) -> Result<Status, String> {
        let cid = self.qp.push(sqe).ok_or("queue full")?;
        self.qp.ring_sq();
        let start = Instant::now();
        loop {
            if let Some(done) = self.qp.poll() {
                self.qp.ring_cq();
                let (slot, cqe) = done.map_err(|e| e.to_string())?;
                assert_eq!(slot, cid);
                return Ok(cqe.status());
            }
            if start.elapsed() > timeout {
                return Err(format!("no completion within {timeout:?}"));
            }
            std::thread::yield_now();
        }
    }

    pub fn rw(&mut self, op: Opcode, lba: u64, blocks: u32, offset: usize) -> Status {
        let p = self.prps(offset, u64::from(blocks) * 512);
        self.run(
            Sqe::read_write(op, 1, lba, blocks, p),
            Duration::from_secs(10),
        )
        .unwrap()
    }
}

impl Fixture {
    /// Unmaps the queue memory and the data buffer, once the queue pair was deleted.
    pub fn unmap(self, proxy: &Proxy) {
        for h in self.handles {
            proxy.unmap(h).unwrap();
        }
    }
}

/// xorshift64*: reproducible streams for the tests' choices.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}
