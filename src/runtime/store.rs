//! A task's local state: one RocksDB database per task (inbox partition), one column family per
//! store, plus a `meta` family holding, per changelog partition, the last changelog offset the data
//! reflects. Data and its offset change in one `WriteBatch`, so after a crash the database is
//! always a prefix of the changelog and a restart restores only the tail.
//!
//! Writes of a batch in progress are staged in memory ([`Staged`]) and reach RocksDB only after the
//! Kafka transaction that carries their changelog records committed; an aborted transaction simply
//! drops the staging, so local state never runs ahead of the committed changelog.
//!
//! The write-ahead log is off: the Kafka changelogs are the durable copy, and `atomic_flush` writes
//! every family's memtable in one step, so what a crash leaves on disk is still a prefix of the
//! writes (data with its offsets) and the restore replays the rest, at most the memtable budget.
//! A clean close flushes the memtables, so a rebalance or a stop replays nothing.
//!
//! Key layout: store families are named after the stores (`dedup`, `sequence`, `jobs`, ...). The
//! hub task changelogs all three to one topic, the jobs changelog: a jobs key is its changelog key
//! byte for byte, a dedup or sequence key is its changelog key without the `d/` or `s/` in front
//! (see `hub::task`). `meta` keys are `offset/<family>` → big-endian i64: how far the family's
//! changelog has been applied (the jobs family's offset counts for all three; the dedup and
//! sequence families' for the changelogs earlier versions wrote). `written_at` → big-endian i64:
//! when the store was last written (ms since the epoch).
use std::path::Path;

use std::sync::LazyLock;

use rocksdb::{
    Cache, ColumnFamilyDescriptor, DB, Options, WriteBatch, WriteBufferManager, WriteOptions,
};

/// Memory every store of the process shares: memtables are bounded together (a backlog of
/// millions of jobs lives on disk, not in RAM), and one block cache serves all reads. The two are
/// separate budgets: charging the memtables to the block cache (as this did before) kept the cache
/// full of their reservations, so every point read fetched, checksummed and decompressed an index
/// block from the file again (62% of the hub's CPU in the `throughput` scenario; BENCHMARKS.md).
const MEMTABLE_BUDGET: usize = 64 << 20;
const BLOCK_CACHE: usize = 32 << 20;
static SHARED_CACHE: LazyLock<Cache> = LazyLock::new(|| Cache::new_lru_cache(BLOCK_CACHE));
static SHARED_MEMTABLES: LazyLock<WriteBufferManager> =
    LazyLock::new(|| WriteBufferManager::new_write_buffer_manager(MEMTABLE_BUDGET, false));

fn family_options() -> Options {
    let mut o = Options::default();
    o.set_write_buffer_size(8 << 20);
    o.set_max_write_buffer_number(2);
    o.set_compression_type(rocksdb::DBCompressionType::Lz4);
    // A Bloom filter over each memtable's keys too: a point read that misses (new dedup keys,
    // new payloads) skips the skip-list search of every memtable.
    o.set_memtable_prefix_bloom_ratio(0.05);
    o.set_memtable_whole_key_filtering(true);
    let mut table = rocksdb::BlockBasedOptions::default();
    table.set_block_cache(&SHARED_CACHE);
    // Most point reads miss (a new event's dedup key, a new job's key): a Bloom filter answers
    // them without reading and decompressing a data block of every file (28% of the hub's CPU
    // under load went to such misses). Filters are kept with the index blocks, in the cache.
    table.set_bloom_filter(10.0, false);
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    o.set_block_based_table_factory(&table);
    o
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error("unknown store {0}")]
    UnknownStore(String),
}

/// Where a [`Store::visit_within`] scan stops.
#[derive(Clone, Copy)]
pub struct Bounds<'a> {
    /// The first key not read (RocksDB's `iterate_upper_bound`).
    pub until: Option<&'a [u8]>,
    /// Most internal entries stepped over (RocksDB's `max_skippable_internal_keys`; 0: no cap):
    /// until a compaction a deleted key is two, its tombstone and the put it hides.
    pub skip_at_most: u64,
}

/// A key and its value, as read from a store.
pub type KeyValue = (Vec<u8>, Vec<u8>);

pub struct Store {
    db: DB,
    families: Vec<&'static str>,
}

const META: &str = "meta";
const WRITTEN_AT: &[u8] = b"written_at";

impl Store {
    /// Opens (or creates) the database at `path` with the given store families.
    pub fn open(path: &Path, families: &[&'static str]) -> Result<Store, StoreError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_max_background_jobs(2);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        opts.set_write_buffer_size(8 << 20);
        opts.set_write_buffer_manager(&SHARED_MEMTABLES);
        opts.set_atomic_flush(true);
        let mut cfs: Vec<ColumnFamilyDescriptor> = families
            .iter()
            .map(|f| ColumnFamilyDescriptor::new(*f, family_options()))
            .collect();
        cfs.push(ColumnFamilyDescriptor::new(META, family_options()));
        let db = DB::open_cf_descriptors(&opts, path, cfs)?;
        Ok(Store {
            db,
            families: families.to_vec(),
        })
    }

    fn cf(&self, family: &str) -> Result<&rocksdb::ColumnFamily, StoreError> {
        self.db
            .cf_handle(family)
            .ok_or_else(|| StoreError::UnknownStore(family.to_string()))
    }

    pub fn get(&self, family: &str, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.db.get_cf(self.cf(family)?, key)?)
    }

    /// The last changelog offset applied to `family` (None: nothing yet).
    pub fn changelog_offset(&self, family: &str) -> Result<Option<i64>, StoreError> {
        let key = format!("offset/{family}");
        Ok(self
            .db
            .get_cf(self.cf(META)?, key.as_bytes())?
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map(i64::from_be_bytes))
    }

    /// When the store was last written (wall clock, ms since the epoch; None: never, or by a
    /// version that did not record it). See [`Store::apply_at`].
    pub fn written_at(&self) -> Result<Option<i64>, StoreError> {
        Ok(self
            .db
            .get_cf(self.cf(META)?, WRITTEN_AT)?
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map(i64::from_be_bytes))
    }

    /// Records that the store was current at `at` (ms since the epoch), writing nothing else.
    pub fn stamp(&self, at: i64) -> Result<(), StoreError> {
        self.apply_at(Staged::default(), &[], at)
    }

    /// Applies staged writes and the new changelog offsets atomically, stamped with the time.
    pub fn apply(&self, staged: Staged, offsets: &[(&str, i64)]) -> Result<(), StoreError> {
        use crate::runtime::clock::Clock;
        self.apply_at(staged, offsets, crate::runtime::clock::SystemClock.now_ms())
    }

    /// [`Store::apply`] stamped with `written_at` (ms since the epoch): how old the store is
    /// tells whether a restore may start from its offsets (tombstones written to the compacted
    /// changelog since then may be gone: `hub::task`).
    pub fn apply_at(
        &self,
        staged: Staged,
        offsets: &[(&str, i64)],
        written_at: i64,
    ) -> Result<(), StoreError> {
        // Sized up front: a batch of a few thousand payloads grew by doubling, each step a copy
        // into freshly mapped pages (page faults showed in the hub thread's profile). Per entry
        // RocksDB adds a tag, a column family id and two length varints: 16 bytes covers them.
        let bytes: usize = staged
            .families
            .iter()
            .flat_map(|(_, writes)| writes.iter())
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len) + 16)
            .sum::<usize>()
            + offsets.len() * 48
            + 12;
        let mut batch = WriteBatch::with_capacity_bytes(bytes);
        for (family, writes) in staged.families {
            let cf = self.cf(family)?;
            // In key order: the memtable's skip list starts each insert from where the last one
            // went in, so ascending keys skip most of the search from the top that a hash map's
            // order costs on every insert.
            let mut writes: Vec<_> = writes.into_iter().collect();
            writes.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            for (key, value) in writes {
                match value {
                    Some(v) => batch.put_cf(cf, key, v),
                    None => batch.delete_cf(cf, key),
                }
            }
        }
        let meta = self.cf(META)?;
        for (family, offset) in offsets {
            batch.put_cf(
                meta,
                format!("offset/{family}").as_bytes(),
                offset.to_be_bytes(),
            );
        }
        batch.put_cf(meta, WRITTEN_AT, written_at.to_be_bytes());
        let mut no_wal = WriteOptions::default();
        no_wal.disable_wal(true);
        self.db.write_opt(batch, &no_wal)?;
        Ok(())
    }

    /// Keys of `family` in order, starting at `from`, at most `limit` (for expiry indexes).
    pub fn scan_from(
        &self,
        family: &str,
        from: &[u8],
        limit: usize,
    ) -> Result<Vec<KeyValue>, StoreError> {
        let cf = self.cf(family)?;
        let mut out = Vec::new();
        let iter = self.db.iterator_cf(
            cf,
            rocksdb::IteratorMode::From(from, rocksdb::Direction::Forward),
        );
        for item in iter.take(limit) {
            let (k, v) = item?;
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    /// Visits keys of `family` in order from `from` while `visit` returns true, at most `limit`;
    /// returns how many it visited (no copies: for counting).
    pub fn visit_from(
        &self,
        family: &str,
        from: &[u8],
        limit: usize,
        visit: impl FnMut(&[u8]) -> bool,
    ) -> Result<usize, StoreError> {
        let all = Bounds {
            until: None,
            skip_at_most: 0,
        };
        let visited = self.visit_within(family, from, all, limit, visit)?;
        Ok(visited.unwrap_or_default())
    }

    /// As [`Store::visit_from`], within `bounds`: keys from `bounds.until` on are not read, nor
    /// the deleted keys before them that RocksDB would otherwise step over to reach the next live
    /// one. `None` when more than `bounds.skip_at_most` deleted keys came before the next live
    /// key or the end (nothing known past the keys visited).
    pub fn visit_within(
        &self,
        family: &str,
        from: &[u8],
        bounds: Bounds<'_>,
        limit: usize,
        mut visit: impl FnMut(&[u8]) -> bool,
    ) -> Result<Option<usize>, StoreError> {
        let cf = self.cf(family)?;
        let mut opts = rocksdb::ReadOptions::default();
        if let Some(until) = bounds.until {
            opts.set_iterate_upper_bound(until);
        }
        opts.set_max_skippable_internal_keys(bounds.skip_at_most);
        let mut iter = self.db.raw_iterator_cf_opt(cf, opts);
        iter.seek(from);
        let mut n = 0;
        while n < limit && iter.valid() {
            let Some(k) = iter.key() else { break };
            if !visit(k) {
                break;
            }
            n += 1;
            iter.next();
        }
        match iter.status() {
            Err(e) if bounds.skip_at_most > 0 && e.kind() == rocksdb::ErrorKind::Incomplete => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
            Ok(()) => Ok(Some(n)),
        }
    }

    /// Number of keys (approximate, from RocksDB's estimate), for metrics and tests.
    pub fn estimate_keys(&self, family: &str) -> Result<u64, StoreError> {
        Ok(self
            .db
            .property_int_value_cf(self.cf(family)?, "rocksdb.estimate-num-keys")?
            .unwrap_or(0))
    }

    pub fn families(&self) -> &[&'static str] {
        &self.families
    }
}

/// The hash maps of a batch's hot path: foldhash, seeded per process (SipHash was ~2% of the hub's
/// CPU under load, mostly hashing staged keys).
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// One family's staged writes: key → value (None: a delete).
type FamilyWrites = FastMap<Vec<u8>, Option<Vec<u8>>>;

/// Writes of one batch, readable before they are applied (read-your-writes inside the batch).
/// One map per family, so a lookup hashes the borrowed key without copying it.
#[derive(Default)]
pub struct Staged {
    families: Vec<(&'static str, FamilyWrites)>,
}

impl Staged {
    fn family(&mut self, family: &'static str) -> &mut FamilyWrites {
        let i = match self.families.iter().position(|(f, _)| *f == family) {
            Some(i) => i,
            None => {
                self.families.push((family, FastMap::default()));
                self.families.len() - 1
            }
        };
        &mut self.families[i].1
    }

    fn writes_of(&self, family: &str) -> Option<&FamilyWrites> {
        self.families
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, m)| m)
    }

    pub fn put(&mut self, family: &'static str, key: Vec<u8>, value: Vec<u8>) {
        self.family(family).insert(key, Some(value));
    }

    pub fn delete(&mut self, family: &'static str, key: Vec<u8>) {
        self.family(family).insert(key, None);
    }

    /// Drops whatever this batch wrote to `key` in `family`: nothing of it reaches the store. For
    /// a key the batch created and deleted again, which the store never held.
    pub fn forget(&mut self, family: &'static str, key: &[u8]) {
        self.family(family).remove(key);
    }

    /// Keys this batch puts (not deletes) in `family`.
    pub fn puts_in<'a>(&'a self, family: &'static str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.writes_of(family)
            .into_iter()
            .flatten()
            .filter(|(_, v)| v.is_some())
            .map(|(k, _)| k.as_slice())
    }

    /// Every key this batch writes in `family` with its final value (None: a delete).
    pub fn writes_in<'a>(
        &'a self,
        family: &'static str,
    ) -> impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)> + 'a {
        self.writes_of(family)
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
    }

    /// The staged value if this batch wrote the key (Some(None) = staged delete), else None.
    pub fn get(&self, family: &'static str, key: &[u8]) -> Option<Option<&[u8]>> {
        self.writes_of(family)?.get(key).map(|v| v.as_deref())
    }

    /// Reads through the staging to the store.
    pub fn read(
        &self,
        store: &Store,
        family: &'static str,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        match self.get(family, key) {
            Some(v) => Ok(v.map(<[u8]>::to_vec)),
            None => store.get(family, key),
        }
    }

    pub fn len(&self) -> usize {
        self.families.iter().map(|(_, m)| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.families.iter().all(|(_, m)| m.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_writes_are_invisible_in_the_store_until_applied() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &["dedup"]).unwrap();
        let mut staged = Staged::default();
        staged.put("dedup", b"k".to_vec(), b"v".to_vec());
        assert_eq!(
            staged.read(&store, "dedup", b"k").unwrap().as_deref(),
            Some(b"v".as_slice())
        );
        assert_eq!(store.get("dedup", b"k").unwrap(), None);
        store.apply(staged, &[("dedup", 41)]).unwrap();
        assert_eq!(
            store.get("dedup", b"k").unwrap().as_deref(),
            Some(b"v".as_slice())
        );
        assert_eq!(store.changelog_offset("dedup").unwrap(), Some(41));
    }

    #[test]
    fn dropped_staging_leaves_the_store_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &["dedup"]).unwrap();
        let mut staged = Staged::default();
        staged.put("dedup", b"k".to_vec(), b"v".to_vec());
        drop(staged); // the transaction aborted
        assert_eq!(store.get("dedup", b"k").unwrap(), None);
        assert_eq!(store.changelog_offset("dedup").unwrap(), None);
    }

    #[test]
    fn data_and_offset_survive_a_reopen_together() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path(), &["dedup", "sequence"]).unwrap();
            let mut staged = Staged::default();
            staged.put("sequence", b"t1".to_vec(), 7u64.to_be_bytes().to_vec());
            staged.delete("dedup", b"gone".to_vec());
            store.apply(staged, &[("sequence", 9)]).unwrap();
        }
        let store = Store::open(dir.path(), &["dedup", "sequence"]).unwrap();
        assert_eq!(
            store.get("sequence", b"t1").unwrap(),
            Some(7u64.to_be_bytes().to_vec())
        );
        assert_eq!(store.changelog_offset("sequence").unwrap(), Some(9));
        assert_eq!(store.changelog_offset("dedup").unwrap(), None);
    }

    /// The child half of `a_crash_leaves_data_and_offsets_at_the_same_write`: fills one family
    /// until RocksDB has flushed it once, writes a few more batches, then dies without closing
    /// the database (no destructor runs, as with SIGKILL). Prints the last batch it wrote.
    #[test]
    #[ignore = "run by a_crash_leaves_data_and_offsets_at_the_same_write in a child process"]
    fn crash_child() {
        let Some(dir) = std::env::var_os("STORE_CRASH_DIR") else {
            return;
        };
        let store = Store::open(Path::new(&dir), &["jobs", "dedup"]).unwrap();
        let flushed = |s: &Store| {
            let cf = s.cf("jobs").unwrap();
            s.db.property_int_value_cf(cf, "rocksdb.num-files-at-level0")
                .unwrap()
                .unwrap_or(0)
                > 0
        };
        let mut i = 0i64;
        let mut after_flush = None;
        while after_flush.is_none_or(|n| i < n + 20) {
            i += 1;
            let mut staged = Staged::default();
            // Big values in `jobs` fill its memtable; `dedup` and the offsets stay small.
            staged.put(
                "jobs",
                b"k".to_vec(),
                [i.to_be_bytes().to_vec(), vec![7; 64 << 10]].concat(),
            );
            staged.put("dedup", b"k".to_vec(), i.to_be_bytes().to_vec());
            store.apply(staged, &[("jobs", i), ("dedup", i)]).unwrap();
            if after_flush.is_none() && flushed(&store) {
                after_flush = Some(i);
            }
            assert!(i < 100_000, "no flush happened");
        }
        println!("last-batch={i}");
        std::process::abort();
    }

    #[test]
    fn a_crash_leaves_data_and_offsets_at_the_same_write() {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "runtime::store::tests::crash_child", "--ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env("STORE_CRASH_DIR", dir.path())
            .output()
            .unwrap();
        assert!(!out.status.success(), "the child must die, not exit");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last: i64 = stdout
            .split("last-batch=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("child output: {stdout}"));
        let store = Store::open(dir.path(), &["jobs", "dedup"]).unwrap();
        let at = |family: &str| -> Option<i64> {
            store
                .get(family, b"k")
                .unwrap()
                .map(|v| i64::from_be_bytes(v[..8].try_into().unwrap()))
        };
        let mark = store.changelog_offset("jobs").unwrap();
        // What survived is one point of the write sequence: both families and both offsets
        // (a family flushed alone would leave data ahead of, or behind, its offset).
        assert!(
            mark.is_some(),
            "the flushed writes survived with their offsets"
        );
        assert_eq!(store.changelog_offset("dedup").unwrap(), mark);
        assert_eq!(at("jobs"), mark);
        assert_eq!(at("dedup"), mark);
        // Without a write-ahead log the unflushed tail is gone; the changelog restores it.
        assert!(
            mark.unwrap() < last,
            "batches after the last flush were lost"
        );
    }

    #[test]
    fn scan_from_walks_keys_in_order_from_a_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &["expiry"]).unwrap();
        let mut staged = Staged::default();
        for t in [30u64, 10, 20] {
            staged.put("expiry", t.to_be_bytes().to_vec(), vec![]);
        }
        store.apply(staged, &[]).unwrap();
        let keys: Vec<u64> = store
            .scan_from("expiry", &15u64.to_be_bytes(), 10)
            .unwrap()
            .into_iter()
            .map(|(k, _)| u64::from_be_bytes(k.try_into().unwrap()))
            .collect();
        assert_eq!(keys, [20, 30]);
    }
}
