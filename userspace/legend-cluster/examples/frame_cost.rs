//! What authenticating the control connections' frames costs: HMAC-SHA-256 and keyed BLAKE3 (the
//! frames' MAC) alone on this machine, and frames of growing size between two hosts of one job
//! on loopback (sealed, as the job sends them) against the same bytes on a bare loopback TCP
//! connection.
//!
//! `cargo run --release -p legend-cluster --example frame_cost`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use hmac::{KeyInit, Mac};
use legend_cluster::{Cluster, Launch, LaunchSource, Options, Token, join};

/// Bytes moved for each frame size: enough for a steady rate, little enough to stay quick.
const VOLUME: usize = 1 << 30;

fn mb_per_s(bytes: usize, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e6
}

/// Two hosts of one job on loopback.
fn two_hosts() -> (Cluster, Cluster) {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let options = |name: &str| {
        let mut o = Options::new(Token::new("frame-cost-token-0123").expect("a token"));
        o.name = name.into();
        o
    };
    let launch = move |rank| Launch {
        hosts: 2,
        rank,
        rendezvous: format!("127.0.0.1:{port}"),
        source: LaunchSource::CommandLine,
    };
    let one = std::thread::spawn(move || join(&launch(1), &Default::default(), &options("one")));
    let zero = join(&launch(0), &Default::default(), &options("zero")).expect("host 0 joins");
    (zero, one.join().expect("host 1").expect("host 1 joins"))
}

/// The same bytes on a bare loopback connection, in writes of `size`: MB/s.
fn bare_tcp(payload: &[u8], count: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
    let addr = listener.local_addr().expect("its address");
    let size = payload.len();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("a connection");
        let mut buf = vec![0u8; size];
        for _ in 0..count {
            s.read_exact(&mut buf).expect("reads");
        }
    });
    let mut s = TcpStream::connect(addr).expect("connects");
    let started = Instant::now();
    for _ in 0..count {
        s.write_all(payload).expect("writes");
    }
    reader.join().expect("the reader");
    mb_per_s(size * count, started.elapsed())
}

fn main() {
    let buf = vec![0x5au8; 64 << 20];
    let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&[1; 32]).expect("a key");
    let started = Instant::now();
    for _ in 0..VOLUME / buf.len() {
        mac.update(&buf);
    }
    std::hint::black_box(mac.finalize());
    println!(
        "HMAC-SHA-256 alone: {:.0} MB/s on one core",
        mb_per_s(VOLUME, started.elapsed())
    );
    let mut b3 = blake3::Hasher::new_keyed(&[1; 32]);
    let started = Instant::now();
    for _ in 0..VOLUME / buf.len() {
        for piece in buf.chunks(1 << 16) {
            b3.update(piece);
        }
    }
    std::hint::black_box(b3.finalize());
    println!(
        "BLAKE3 keyed alone: {:.0} MB/s on one core",
        mb_per_s(VOLUME, started.elapsed())
    );
    let (zero, one) = two_hosts();
    println!("frame size   sealed frames, host 1 to host 0   bare loopback TCP");
    for size in [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
        let count = (VOLUME / size).max(4);
        let payload = &buf[..size];
        let started = Instant::now();
        let receiver = {
            let zero = zero.clone();
            std::thread::spawn(move || {
                for _ in 0..count {
                    zero.recv(1, 1, None, "frames").expect("a frame");
                }
            })
        };
        for _ in 0..count {
            one.send(0, 1, &[payload]).expect("sent");
        }
        receiver.join().expect("the receiver");
        let sealed = mb_per_s(size * count, started.elapsed());
        println!(
            "{:>7} KiB   {sealed:>10.0} MB/s                   {:>6.0} MB/s",
            size >> 10,
            bare_tcp(payload, count)
        );
    }
    zero.finish(false);
    one.finish(false);
}
