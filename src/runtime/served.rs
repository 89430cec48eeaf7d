//! A producer whose delivery reports are served by a thread that sleeps until librdkafka has
//! some. rdkafka's `ThreadedProducer` (and the `FutureProducer` built on it) serves them by
//! polling in 100 ms slices, and the end of each slice is a busy loop: its poll rounds the time
//! left down to whole milliseconds, and a wait of zero returns at once, so the last millisecond
//! of every slice spins. That was about 0.9% of a core per producer, idle or not, and two of
//! them were about half of an idle instance's CPU (BENCHMARKS.md, session 63).
//!
//! Here librdkafka writes a byte to a pipe when its queue of events goes from empty to not
//! empty (`rd_kafka_queue_io_event_enable`), and the thread blocks reading that pipe: it wakes
//! when there is something to serve, serves the whole queue, and sleeps again.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::bindings as rdsys;
use rdkafka::producer::{BaseProducer, ProducerContext};

/// A [`BaseProducer`] with its delivery reports (and error events) served as they come, by a
/// thread of its own. Dereferences to the producer.
pub struct Served<C: ProducerContext + 'static> {
    producer: Arc<BaseProducer<C>>,
    stop: Arc<AtomicBool>,
    /// The pipe's writing end: librdkafka writes to its descriptor, and so does `drop` to wake
    /// the thread for the last time.
    bell: File,
    wakeups: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The producer's main queue (where its delivery reports and errors go), held for the call.
struct MainQueue(*mut rdsys::rd_kafka_queue_t);

// SAFETY: librdkafka's queue handles may be used from any thread.
unsafe impl Send for MainQueue {}

impl MainQueue {
    fn of<C: ProducerContext>(producer: &BaseProducer<C>) -> MainQueue {
        use rdkafka::producer::Producer;
        // SAFETY: the client's handle is live while the producer is; the queue handle returned is
        // a new reference, released in `drop`.
        MainQueue(unsafe { rdsys::rd_kafka_queue_get_main(producer.client().native_ptr()) })
    }

    fn len(&self) -> usize {
        // SAFETY: a live queue handle (see `of`).
        unsafe { rdsys::rd_kafka_queue_length(self.0) }
    }

    /// Has librdkafka write a byte to `fd` when the queue goes from empty to not empty; `-1`
    /// stops it.
    fn ring(&self, fd: i32) {
        const BYTE: &[u8; 1] = b"1";
        // SAFETY: a live queue handle; librdkafka copies the payload.
        unsafe {
            rdsys::rd_kafka_queue_io_event_enable(self.0, fd, BYTE.as_ptr().cast(), BYTE.len());
        }
    }
}

impl Drop for MainQueue {
    fn drop(&mut self) {
        // SAFETY: the reference taken in `of`, released once.
        unsafe { rdsys::rd_kafka_queue_destroy(self.0) }
    }
}

impl<C: ProducerContext + 'static> Served<C> {
    /// Starts serving `producer`'s events; `name` names the thread.
    pub fn new(producer: BaseProducer<C>, name: &str) -> std::io::Result<Served<C>> {
        if name.contains('\0') {
            // The thread's spawn would panic on it, after librdkafka was given the descriptor.
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        let (reader, bell) = pipe()?;
        // librdkafka writes from its own threads, which must never block on a full pipe (a
        // full pipe holds a wake-up already).
        let fd = bell.as_raw_fd();
        // SAFETY: fcntl on a descriptor this function owns.
        let set = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !set {
            return Err(std::io::Error::last_os_error());
        }
        let producer = Arc::new(producer);
        let stop = Arc::new(AtomicBool::new(false));
        let wakeups = Arc::new(AtomicU64::new(0));
        MainQueue::of(&producer).ring(fd);
        let thread = std::thread::Builder::new().name(name.into()).spawn({
            let (producer, stop, wakeups) = (producer.clone(), stop.clone(), wakeups.clone());
            move || serve(&producer, reader, &stop, &wakeups)
        });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                MainQueue::of(&producer).ring(-1);
                return Err(e);
            }
        };
        Ok(Served {
            producer,
            stop,
            bell,
            wakeups,
            thread: Some(thread),
        })
    }

    /// How many times the serving thread has woken up to serve events.
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }
}

/// A pipe's reading and writing ends, closed on exec.
fn pipe() -> std::io::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new, and owned by what this returns from here on.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((File::from(reader), File::from(writer)))
}

/// The serving thread: serves the whole queue, then sleeps until the pipe says there is more.
/// `poll(ZERO)` serves at most one event per call, hence the loop on the queue's length. A read
/// that fails (it should not) leaves the thread polling in slices, as rdkafka's own would.
fn serve<C: ProducerContext>(
    producer: &BaseProducer<C>,
    mut pipe: File,
    stop: &AtomicBool,
    wakeups: &AtomicU64,
) {
    let queue = MainQueue::of(producer);
    let mut buf = [0u8; 64];
    let mut bell_broken = false;
    while !stop.load(Ordering::Relaxed) {
        while queue.len() > 0 && !stop.load(Ordering::Relaxed) {
            producer.poll(Duration::ZERO);
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if bell_broken {
            producer.poll(Duration::from_millis(100));
            continue;
        }
        match pipe.read(&mut buf) {
            Ok(n) if n > 0 => {
                wakeups.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => {
                tracing::warn!(result = ?other.map(|_| ()), "a producer's wake-up pipe failed; its events are polled for instead");
                bell_broken = true;
            }
        }
    }
}

impl<C: ProducerContext + 'static> std::ops::Deref for Served<C> {
    type Target = BaseProducer<C>;
    fn deref(&self) -> &BaseProducer<C> {
        &self.producer
    }
}

impl<C: ProducerContext + 'static> Drop for Served<C> {
    fn drop(&mut self) {
        // librdkafka stops writing to the pipe before its descriptor closes (with the fields,
        // after this): a descriptor number closed and reused must not get its bytes.
        MainQueue::of(&self.producer).ring(-1);
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.bell.write(b"s");
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where a delivery report goes: to the task awaiting it ([`send_awaited`]).
type Reply = tokio::sync::oneshot::Sender<Result<(i32, i64), rdkafka::error::KafkaError>>;

/// A producer context that hands each record's delivery report to the task that sent it
/// ([`send_awaited`]): what rdkafka's `FutureProducer` does, on a [`Served`] producer.
#[derive(Default)]
pub struct Awaited;

impl rdkafka::ClientContext for Awaited {}

impl ProducerContext for Awaited {
    type DeliveryOpaque = Box<Reply>;
    fn delivery(&self, result: &rdkafka::producer::DeliveryResult<'_>, reply: Box<Reply>) {
        use rdkafka::Message;
        let outcome = match result {
            Ok(m) => Ok((m.partition(), m.offset())),
            Err((e, _)) => Err(e.clone()),
        };
        let _ = reply.send(outcome);
    }
}

/// Sends one record and waits for its delivery report: its partition and offset, or why it
/// failed. While the producer's queue is full it tries again, for `queue_timeout` at most (as
/// rdkafka's `FutureProducer::send`). A producer closed before the report answers `Canceled`.
pub async fn send_awaited(
    producer: &BaseProducer<Awaited>,
    topic: &str,
    key: &str,
    payload: Option<&[u8]>,
    queue_timeout: Duration,
) -> Result<(i32, i64), rdkafka::error::KafkaError> {
    use rdkafka::error::KafkaError;
    use rdkafka::types::RDKafkaErrorCode;
    let deadline = tokio::time::Instant::now() + queue_timeout;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut record = rdkafka::producer::BaseRecord::with_opaque_to(topic, Box::new(tx)).key(key);
    if let Some(p) = payload {
        record = record.payload(p);
    }
    loop {
        match producer.send(record) {
            Ok(()) => break,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                if tokio::time::Instant::now() < deadline =>
            {
                record = back;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err((e, _)) => return Err(e),
        }
    }
    rx.await.unwrap_or(Err(KafkaError::Canceled))
}
