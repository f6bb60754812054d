//! A persistent thread pool for splitting one operation (a matmul, a read-bandwidth probe)
//! across cores.
//!
//! Guarantees:
//! - Threads are spawned once in [`ThreadPool::new`] and joined when the pool is dropped.
//! - [`ThreadPool::run`] calls `f(i)` exactly once for every `i in 0..n_tasks` and returns only
//!   when every call has returned; the calling thread takes tasks too.
//! - `run` allocates nothing and spawns nothing. Between jobs the workers spin for a short
//!   while on an atomic generation counter (a token runs hundreds of operations back to back),
//!   then park on a condition variable so an idle pool costs no CPU.
//! - A nested `run` (from inside a task) or a concurrent `run` from another thread does not
//!   deadlock: it runs its tasks serially on the calling thread.
//! - A panic inside a task is caught, the remaining tasks still complete, and the panic is
//!   re-raised on the thread that called `run`.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins on the generation counter before parking.
const SPIN_TIME: Duration = Duration::from_micros(200);

/// The task function of the current job, type-erased: a thin pointer to a `&dyn Fn(usize)`
/// that lives on the stack of the thread inside `run`.
type TaskRef<'a> = &'a (dyn Fn(usize) + Sync + 'a);

/// State shared by the caller of `run` and the workers.
struct Shared {
    /// `generation << 32 | remaining`: the job's generation and how many of its tasks are not
    /// yet claimed. A task is claimed by a compare-and-swap that decrements `remaining`; the
    /// claimed index is the new `remaining`. Because the generation is part of the same word, a
    /// worker that is late cannot claim a task of a newer job by mistake.
    state: AtomicU64,
    /// Pointer to the `TaskRef` of the current job; written before `state` is published.
    job: AtomicPtr<()>,
    /// Tasks of the current job that have returned.
    completed: AtomicUsize,
    /// Set when a task of the current job panicked; the payload is kept for the caller.
    panicked: AtomicBool,
    panic_payload: Mutex<Option<Box<dyn Any + Send>>>,
    /// True while a `run` owns the workers; a second `run` meanwhile goes serial.
    busy: AtomicBool,
    /// Parking for idle workers.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    /// Workers that have entered their loop (thread start-up, which allocates, is behind them).
    started: AtomicUsize,
}

/// Runs `f(task)` for every task in `0..n_tasks` across the pool's threads.
pub struct ThreadPool {
    threads: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl ThreadPool {
    /// A pool of `threads` threads in total: the calling thread plus `threads - 1` workers.
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            completed: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            panic_payload: Mutex::new(None),
            busy: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            started: AtomicUsize::new(0),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let shared = Arc::clone(&shared);
            let spawned =
                std::thread::Builder::new().name(format!("kylin-pool-{i}")).spawn(move || worker_loop(&shared, 0));
            match spawned {
                Ok(handle) => workers.push(handle),
                // Could not spawn (resource limits): run with the threads we have.
                Err(_) => break,
            }
        }
        // Wait until every worker runs its loop, so that thread start-up (which allocates) is
        // over when `new` returns: from then on the pool allocates nothing.
        while shared.started.load(Ordering::Acquire) < workers.len() {
            std::thread::yield_now();
        }
        ThreadPool { threads: workers.len() + 1, shared, workers }
    }

    /// Number of threads that run tasks, including the caller of [`ThreadPool::run`].
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(i)` for each `i in 0..n_tasks`, returning when all calls have returned.
    ///
    /// Tasks are claimed dynamically, so a core slowed by another process takes fewer of them.
    /// Panics (after all tasks are done) if a task panicked.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if n_tasks == 1 || self.workers.is_empty() || n_tasks > u32::MAX as usize {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let shared = &*self.shared;
        if shared.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            // Nested or concurrent use: the workers belong to another job. Run serially.
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }

        let task_ref: TaskRef<'_> = f;
        shared.job.store(&task_ref as *const TaskRef<'_> as *mut (), Ordering::Relaxed);
        shared.completed.store(0, Ordering::Relaxed);
        shared.panicked.store(false, Ordering::Relaxed);
        let generation = (shared.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xFFFF_FFFF;
        // Publishes the job (SeqCst pairs with the sleepers check in `worker_loop`).
        shared.state.store(generation << 32 | n_tasks as u64, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }

        // The caller takes tasks too.
        run_tasks(shared, generation);

        // Wait for the tasks taken by workers. They are running, so this is a short spin.
        let mut spins = 0u32;
        while shared.completed.load(Ordering::Acquire) < n_tasks {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // No worker holds a task of this job any more, so nobody reads `task_ref` after here.
        shared.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        let panicked = shared.panicked.load(Ordering::Acquire);
        shared.busy.store(false, Ordering::Release);
        if panicked {
            let payload = shared.panic_payload.lock().unwrap_or_else(|e| e.into_inner()).take();
            match payload {
                Some(p) => resume_unwind(p),
                None => panic!("a thread pool task panicked"),
            }
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

/// Claims and runs tasks of job `generation` until none are left.
fn run_tasks(shared: &Shared, generation: u64) {
    let mut state = shared.state.load(Ordering::Acquire);
    loop {
        if state >> 32 != generation || state & 0xFFFF_FFFF == 0 {
            return;
        }
        let index = (state & 0xFFFF_FFFF) - 1;
        match shared.state.compare_exchange_weak(state, state - 1, Ordering::Acquire, Ordering::Acquire) {
            Ok(_) => {
                let job = shared.job.load(Ordering::Relaxed) as *const TaskRef<'static>;
                // SAFETY: we claimed a task of `generation`, so that job is not finished: its
                // caller is blocked in `run` until `completed` counts our task, and `job` still
                // points at its `TaskRef` (it is replaced only by the next job, which cannot
                // start before this one completes). The `'static` is a lie confined to this call.
                let f: TaskRef<'static> = unsafe { *job };
                let result = catch_unwind(AssertUnwindSafe(|| f(index as usize)));
                if let Err(payload) = result {
                    let mut slot = shared.panic_payload.lock().unwrap_or_else(|e| e.into_inner());
                    if slot.is_none() {
                        *slot = Some(payload);
                    }
                    shared.panicked.store(true, Ordering::Release);
                }
                shared.completed.fetch_add(1, Ordering::Release);
                state = shared.state.load(Ordering::Acquire);
            }
            Err(now) => state = now,
        }
    }
}

/// A worker's life: wait for a job newer than `seen`, take its tasks, repeat until shutdown.
///
/// `seen` starts at the generation the pool had when the worker was spawned (0), not at the one
/// it finds when it first runs: a job published before the thread got going is still its job.
fn worker_loop(shared: &Shared, mut seen: u64) {
    shared.started.fetch_add(1, Ordering::Release);
    loop {
        // Wait for a new generation: spin first, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let g = shared.state.load(Ordering::Acquire) >> 32;
            if g != seen {
                break Some(g);
            }
            if shared.shutdown.load(Ordering::Relaxed) {
                break None;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() > SPIN_TIME {
                let mut guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
                shared.sleepers.fetch_add(1, Ordering::SeqCst);
                let woken = loop {
                    let g = shared.state.load(Ordering::SeqCst) >> 32;
                    if g != seen {
                        break Some(g);
                    }
                    if shared.shutdown.load(Ordering::SeqCst) {
                        break None;
                    }
                    guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                };
                shared.sleepers.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
                break woken;
            }
            std::hint::spin_loop();
        };
        let Some(generation) = generation else { return };
        seen = generation;
        run_tasks(shared, generation);
    }
}

/// Number of physical cores (hyper-threads of one core counted once): the default thread count.
///
/// On Linux, counts distinct `(physical id, core id)` pairs in `/proc/cpuinfo`, limited to the
/// CPUs this process may use; elsewhere, or if that fails, [`std::thread::available_parallelism`].
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    #[cfg(target_os = "linux")]
    {
        if let Ok(text) = std::fs::read_to_string("/proc/cpuinfo") {
            let cores = count_physical_cores(&text);
            if cores > 0 {
                return cores.min(logical);
            }
        }
    }
    logical
}

/// Distinct `(physical id, core id)` pairs in the text of `/proc/cpuinfo` (0 if none found).
fn count_physical_cores(cpuinfo: &str) -> usize {
    let mut pairs: Vec<(u64, u64)> = Vec::new();
    let mut package: Option<u64> = None;
    let mut core: Option<u64> = None;
    let mut flush = |package: &mut Option<u64>, core: &mut Option<u64>| {
        if let Some(c) = core.take() {
            let p = package.take().unwrap_or(0);
            if !pairs.contains(&(p, c)) {
                pairs.push((p, c));
            }
        }
        *package = None;
    };
    for line in cpuinfo.lines() {
        if line.trim().is_empty() {
            flush(&mut package, &mut core);
            continue;
        }
        let Some((key, value)) = line.split_once(':') else { continue };
        match key.trim() {
            "physical id" => package = value.trim().parse().ok(),
            "core id" => core = value.trim().parse().ok(),
            _ => {}
        }
    }
    flush(&mut package, &mut core);
    pairs.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for n in [0usize, 1, 2, 3, 7, 64, 1000] {
            let counts: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            pool.run(n, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "n_tasks = {n}");
        }
    }

    #[test]
    fn repeated_runs_see_all_results() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..2000usize {
            pool.run(5, &|i| {
                total.fetch_add(i + round, Ordering::Relaxed);
            });
        }
        let expected: usize = (0..2000usize).map(|r| 5 * r + 10).sum();
        assert_eq!(total.load(Ordering::Relaxed), expected);
    }

    #[test]
    fn runs_after_workers_parked() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(Duration::from_millis(5));
        let total = AtomicUsize::new(0);
        pool.run(10, &|i| {
            total.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn nested_run_does_not_deadlock() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        pool.run(4, &|i| {
            pool.run(3, &|j| {
                total.fetch_add(i * 10 + j, Ordering::Relaxed);
            });
        });
        let expected: usize = (0..4).flat_map(|i| (0..3).map(move |j| i * 10 + j)).sum();
        assert_eq!(total.load(Ordering::Relaxed), expected);
    }

    #[test]
    fn concurrent_runs_from_two_threads() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..200 {
                        pool.run(4, &|i| {
                            total.fetch_add(i, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 2 * 200 * 6);
    }

    #[test]
    fn panic_in_task_reaches_caller_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| {
                if i == 3 {
                    panic!("task 3 failed");
                }
            })
        }));
        assert!(result.is_err());
        let total = AtomicUsize::new(0);
        pool.run(8, &|i| {
            total.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 28);
    }

    #[test]
    fn drop_joins_workers() {
        static EXITED: AtomicUsize = AtomicUsize::new(0);
        struct OnExit;
        impl Drop for OnExit {
            fn drop(&mut self) {
                EXITED.fetch_add(1, Ordering::SeqCst);
            }
        }
        thread_local! { static GUARD: std::cell::RefCell<Option<OnExit>> = const { std::cell::RefCell::new(None) }; }

        let pool = ThreadPool::new(3);
        assert_eq!(pool.threads(), 3);
        let caller = std::thread::current().id();
        let entered = AtomicUsize::new(0);
        // Each task waits until all three have started, so every thread runs exactly one.
        pool.run(3, &|_| {
            entered.fetch_add(1, Ordering::SeqCst);
            while entered.load(Ordering::SeqCst) < 3 {
                std::hint::spin_loop();
            }
            if std::thread::current().id() != caller {
                GUARD.with(|g| *g.borrow_mut() = Some(OnExit));
            }
        });
        drop(pool);
        // Thread-local destructors run when a thread exits, before `join` returns.
        assert_eq!(EXITED.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn pool_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ThreadPool>();
    }

    #[test]
    fn counts_physical_cores_from_cpuinfo() {
        let text = "processor : 0\nphysical id : 0\ncore id : 0\n\nprocessor : 1\nphysical id : 0\ncore id : 0\n\n\
                    processor : 2\nphysical id : 0\ncore id : 1\n\nprocessor : 3\nphysical id : 1\ncore id : 0\n";
        assert_eq!(count_physical_cores(text), 3);
        assert_eq!(count_physical_cores("processor : 0\n"), 0);
        assert!(physical_cores() >= 1);
    }
}
