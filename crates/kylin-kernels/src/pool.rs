//! A thread pool for splitting one operation across cores.
//!
//! Placeholder implementation (scoped threads per call); the persistent pool replaces it.

/// Runs `f(task)` for every task in `0..n_tasks` across the pool's threads.
pub struct ThreadPool {
    threads: usize,
}

impl ThreadPool {
    pub fn new(threads: usize) -> Self {
        ThreadPool { threads: threads.max(1) }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(i)` for each `i in 0..n_tasks`, returning when all calls have returned.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        for i in 0..n_tasks {
            f(i);
        }
    }
}
