//! The `streaming-hub` command: run the hub, manage its topology, print its configuration.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use streaming_hub::app;
use streaming_hub::config::Config;
use streaming_hub::runtime::topology::Topology;

/// jemalloc returns freed memory to the system (background purge threads); glibc's allocator kept
/// the peak of every hub batch resident (BENCHMARKS.md, pending jobs).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "streaming-hub",
    version,
    about = "Kafka-native event delivery hub"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the hub (the default): ingest, HTTP API, metrics.
    Run,
    /// The hub's own topics.
    Topology {
        #[command(subcommand)]
        action: TopologyAction,
    },
    /// Subscriptions as code.
    Subscriptions {
        #[command(subcommand)]
        action: SubscriptionsAction,
    },
    /// Print every STREAMING_HUB_* variable, its default and meaning (Markdown).
    Config,
    /// Replay: move the hub group's offsets on the inbox back (the hub must be stopped).
    Replay {
        /// Every event since this time (RFC 3339) is matched and delivered again.
        #[arg(
            long,
            conflicts_with_all = ["to_offset", "to_offsets"],
            required_unless_present_any = ["to_offset", "to_offsets"]
        )]
        to_datetime: Option<String>,
        /// This offset in every inbox partition, or `earliest`.
        #[arg(long, conflicts_with = "to_offsets")]
        to_offset: Option<String>,
        /// Exactly these offsets, `<partition>:<offset>,…`, forward too: to undo a replay with
        /// the old offsets it printed. Partitions not named stay.
        #[arg(long)]
        to_offsets: Option<String>,
        /// Print where each partition would go, and how many records it would run again;
        /// commit nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Mint an API token (HS256 under STREAMING_HUB_JWT_SECRET).
    Token {
        /// The tenant the token acts for.
        #[arg(long)]
        tenant: Option<String>,
        /// An admin token (must then name the tenant in each request).
        #[arg(long)]
        admin: bool,
        /// Lifetime, e.g. 1h.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
    },
    /// Measure one stage against the real broker (see BENCHMARKS.md).
    Bench {
        /// `ingest`, `hub`, `jobs`, `match` or `deliver`.
        stage: String,
        /// Records to push through.
        #[arg(long, default_value_t = 200_000)]
        records: usize,
        /// Payload bytes per record.
        #[arg(long, default_value_t = 1024)]
        size: usize,
        /// The broker's pid file, to report its CPU too.
        #[arg(long)]
        broker_pid_file: Option<String>,
        /// Reuse this topic prefix (internal: the input writer of `jobs`).
        #[arg(long, hide = true)]
        prefix: Option<String>,
        /// Only write the input (internal: `jobs` runs it as a child process).
        #[arg(long, hide = true)]
        input_only: bool,
    },
    /// End-to-end load harness: starts the hub, a verifying sink and a producer; prints JSON and a
    /// table (scenarios: throughput, latency, latency=<rate> (one rate of the curve), fanout,
    /// slow-sink, backlog=<sink ms>, flaky=<percent of first deliveries refused>, noisy-neighbour,
    /// slow-neighbour, recovery, scale-out, limits, all).
    Load {
        scenario: String,
        /// Measured time per run, after the warm-up.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
        duration: std::time::Duration,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
        warmup: std::time::Duration,
        /// Before the scenarios, run the throughput pipeline unmeasured for at least this long,
        /// so a freshly started broker's JVM has compiled its hot code (a cold broker spent a
        /// quarter of this 2-core machine compiling during the first runs; BENCHMARKS.md).
        #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
        warm_broker: std::time::Duration,
        /// Payload bytes.
        #[arg(long, default_value_t = 1024)]
        size: usize,
        /// Where results.jsonl, latency.png and each run's metrics-*.prom are written.
        #[arg(long, default_value = "target/load")]
        out: std::path::PathBuf,
        /// Leave each run's topics on the broker (deleted by default after a run that missed
        /// nothing; a run that missed deliveries leaves them for tracing).
        #[arg(long)]
        keep_topics: bool,
    },
    /// Produce sample platform events and show what a running hub does with them.
    Demo {
        /// Producer topic to write to.
        #[arg(long, default_value = "lerian.streaming.ledger")]
        topic: String,
        /// Events per second.
        #[arg(long, default_value_t = 20)]
        rate: u32,
        /// Stop after this long (e.g. 60s); default: until Ctrl-C.
        #[arg(long, value_parser = humantime::parse_duration)]
        duration: Option<std::time::Duration>,
        /// The running hub's HTTP address.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        hub_url: String,
    },
}

#[derive(Subcommand)]
enum TopologyAction {
    /// Create missing topics; report (exit 1) existing topics whose settings differ. With
    /// `--dry-run`, a missing topic exits 1 too.
    Apply {
        /// Only report; create nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand)]
enum SubscriptionsAction {
    /// Create or update the subscriptions of a JSON file (GitOps); prints new signing secrets
    /// once. Exit 0 applied, 1 some webhook failed verification, 2 invalid input, 3 broker error,
    /// 4 some entry changed by another writer meanwhile (not written: run again).
    Apply {
        /// The JSON array of subscription definitions.
        #[arg(short = 'f', long = "file")]
        file: std::path::PathBuf,
    },
    /// Seals again under the current KEK every signing secret (expired ones dropped), sensitive
    /// header set and webhook URL sealed under a previous one (ends a KEK rotation), and seals
    /// webhook URLs stored before URLs were sealed. Exit 0 done, 2 some did not open or changed
    /// meanwhile (run again) or no KEK, 3 broker error.
    Reseal {
        /// Also bind sensitive headers sealed before headers were bound to their URL to the URL
        /// their record sends to now (one-off, on upgrade, while the control topic is trusted).
        #[arg(long)]
        bind_unbound: bool,
    },
}

/// The C libraries (librdkafka, RocksDB) allocate with glibc's malloc. Its mmap threshold grows
/// with every large block freed (up to 32 MiB), after which fetch and compression buffers come
/// from the per-thread arenas, which keep what they once held: 650-780 MiB peak resident in the
/// `throughput` benchmark, ten arenas of 24-65 MiB. A fixed 128 KiB threshold (which also stops
/// it from moving) gives large blocks back to the system when freed: 448 MiB, same throughput
/// (BENCHMARKS.md). The arenas are capped at 4 as well. `MALLOC_MMAP_THRESHOLD_` and
/// `MALLOC_ARENA_MAX` in the environment each override their own setting only (setting the
/// threshold dropped the arena cap too).
fn tune_c_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: called first thing in `main`, before any thread exists.
        unsafe {
            if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
            }
            if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
                libc::mallopt(libc::M_ARENA_MAX, 4);
            }
        }
    }
}

/// Raises the soft limit of open files to the hard limit: every webhook host keeps idle
/// keep-alive connections (90 s), RocksDB keeps its files open and librdkafka a socket per
/// broker, and a shell's default soft limit (1,024) is reached by a tenant with a thousand
/// webhooks on as many hosts, after which every accept, file open and connection fails.
fn raise_open_files_limit() {
    #[cfg(target_os = "linux")]
    {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain syscalls on a local struct.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
                l.rlim_cur = l.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            }
        }
    }
}

fn main() -> ExitCode {
    tune_c_allocator();
    raise_open_files_limit();
    let cli = Cli::parse();
    if let Some(Command::Config) = cli.command {
        print!("{}", Config::markdown_table());
        return ExitCode::SUCCESS;
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("streaming-hub: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    app::init_tracing(&config);
    if let Some(Command::Token { tenant, admin, ttl }) = &cli.command {
        if config.jwt_secret.is_empty() {
            eprintln!("streaming-hub token: STREAMING_HUB_JWT_SECRET is not set");
            return ExitCode::from(2);
        }
        if tenant.is_none() && !admin {
            eprintln!("streaming-hub token: give --tenant, or --admin");
            return ExitCode::from(2);
        }
        if let Some(Err(fault)) = tenant
            .as_deref()
            .map(streaming_hub::ingest::tenant::check_tenant)
        {
            eprintln!(
                "streaming-hub token: --tenant {fault}; it must be {} (the API refuses any other)",
                streaming_hub::ingest::tenant::TENANT_RULE
            );
            return ExitCode::from(2);
        }
        println!(
            "{}",
            streaming_hub::api::mint(&config.jwt_secret, tenant.as_deref(), *admin, *ttl)
        );
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("streaming-hub: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async move {
        match cli.command.unwrap_or(Command::Run) {
            Command::Run => match app::run(config).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "hub stopped with an error");
                    ExitCode::from(e.exit_code())
                }
            },
            Command::Topology { action: TopologyAction::Apply { dry_run } } => {
                let topology = match Topology::load(&config.topology_file, &config) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("streaming-hub: {e}");
                        return ExitCode::from(2);
                    }
                };
                match topology.apply(&config, dry_run).await {
                    Ok(findings) => {
                        for f in &findings {
                            println!("{f}");
                        }
                        if findings.iter().any(|f| f.needs_attention()) {
                            eprintln!("streaming-hub: some topics are missing, differ from the topology or could not be compared (see missing, DIFFERS and UNCHECKED lines)");
                            ExitCode::from(1)
                        } else {
                            ExitCode::SUCCESS
                        }
                    }
                    // A topic the hub refuses (as `run` would, exit 2) against Kafka failing (1).
                    Err(e) => {
                        eprintln!("streaming-hub: topology apply failed: {e}");
                        ExitCode::from(if e.is_refusal() { 2 } else { 1 })
                    }
                }
            }
            Command::Subscriptions { action: SubscriptionsAction::Reseal { bind_unbound } } => {
                ExitCode::from(
                    streaming_hub::subscriptions::apply::reseal_command(&config, bind_unbound)
                        .await,
                )
            }
            Command::Subscriptions { action: SubscriptionsAction::Apply { file } } => {
                ExitCode::from(streaming_hub::subscriptions::apply::command(&config, &file).await)
            }
            Command::Bench { stage, records, size, broker_pid_file, prefix, input_only } => {
                let opts = streaming_hub::bench::BenchOptions {
                    stage,
                    records,
                    size,
                    broker_pid_file,
                    prefix,
                    input_only,
                };
                match streaming_hub::bench::run(&config, opts).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("streaming-hub bench: {e}");
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Load { scenario, duration, warmup, warm_broker, size, out, keep_topics } => {
                let opts = streaming_hub::load::LoadOptions {
                    scenario,
                    duration,
                    warmup,
                    warm_broker,
                    size,
                    out,
                    keep_topics,
                };
                match streaming_hub::load::run(&config, opts).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("streaming-hub load: {e}");
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Demo { topic, rate, duration, hub_url } => {
                let opts = streaming_hub::demo::DemoOptions { topic, rate, duration, hub_url };
                match streaming_hub::demo::run(&config, opts).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("streaming-hub demo: {e}");
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Replay { to_datetime, to_offset, to_offsets, dry_run } => {
                let target = match (to_datetime, to_offset, to_offsets) {
                    (Some(t), _, _) => streaming_hub::replay::parse_time(&t),
                    (None, Some(o), _) => streaming_hub::replay::parse_offset(&o),
                    (None, None, Some(o)) => streaming_hub::replay::parse_offsets(&o),
                    (None, None, None) => {
                        Err("give --to-datetime, --to-offset or --to-offsets".to_string())
                    }
                };
                let target = match target {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("streaming-hub replay: {e}");
                        return ExitCode::from(2);
                    }
                };
                let exact = matches!(target, streaming_hub::replay::Target::Exact(_));
                match tokio::task::spawn_blocking(move || streaming_hub::replay::run(&config, &target, !dry_run)).await {
                    Ok(Ok(moved)) => {
                        // Back from a committed offset: a partition never committed starts
                        // at the log start whatever the replay says.
                        let back = moved
                            .iter()
                            .any(|(_, old, new)| old.is_some_and(|o| *new < o));
                        let (mut again, mut skipped) = (0, 0);
                        for (p, old, new) in moved {
                            let what = match old {
                                // Only --to-offsets moves forward: say what it leaves unread.
                                Some(o) if new > o => {
                                    skipped += new - o;
                                    format!("SKIPS up to {} records", new - o)
                                }
                                Some(o) => {
                                    again += o - new;
                                    format!("up to {} records again", o - new)
                                }
                                None => "up to 0 records again".to_string(),
                            };
                            let old = old.map_or("none".to_string(), |o| o.to_string());
                            println!("inbox partition {p}: {old} -> {new} ({what})");
                        }
                        if skipped > 0 {
                            eprintln!(
                                "streaming-hub replay: moved forward: up to {skipped} inbox \
                                 records will not be processed (right only when undoing a replay \
                                 with the offsets it printed)"
                            );
                        }
                        if back {
                            eprintln!(
                                "streaming-hub replay: up to {again} inbox records run again \
                                 (offsets, transaction markers included): each event delivered \
                                 again to the subscriptions it matches now"
                            );
                        }
                        if dry_run {
                            eprintln!(
                                "streaming-hub replay: dry run: nothing committed (nor checked \
                                 that every hub instance is stopped)"
                            );
                        }
                        if !back && !exact {
                            // A dry run says it too: it is where the operator checks the target.
                            eprintln!(
                                "streaming-hub replay: no partition {}: each committed offset \
                                 is at or before the target already (a time after the last \
                                 records?); nothing {} delivered again",
                                if dry_run { "would move" } else { "moved" },
                                if dry_run { "would be" } else { "will be" },
                            );
                        }
                        ExitCode::SUCCESS
                    }
                    Ok(Err(e)) => {
                        eprintln!("streaming-hub replay: {e}");
                        ExitCode::from(1)
                    }
                    Err(e) => {
                        eprintln!("streaming-hub replay: {e}");
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Config | Command::Token { .. } => unreachable!("handled before the runtime starts"),
        }
    });
    // Dropping the runtime would wait for every blocking task still running (an operation's
    // scan or read, a DNS lookup) however long it takes; the process has finished its work.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    code
}
