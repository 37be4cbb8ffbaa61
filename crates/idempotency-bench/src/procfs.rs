//! What Linux's `/proc` tells about processes and the machine: peak resident memory, CPU time,
//! context switches.

use std::{fs, io, path::Path, time::Duration};

/// The peak resident set size (`VmHWM`) of process `pid`, in bytes.
pub(crate) fn peak_rss(pid: u32) -> io::Result<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::other(format!("no VmHWM in /proc/{pid}/status")))
}

/// The CPU time process `pid` has used so far, all its threads together.
///
/// Read from each thread's `schedstat` (nanoseconds) where the kernel has it, else from
/// `stat`'s user and system ticks. Threads that already exited are not counted, which is why
/// callers take differences over a window in which the processes they watch keep their threads.
pub(crate) fn cpu_time(pid: u32) -> io::Result<Duration> {
    sum_over_threads(pid, thread_cpu_time)
}

/// The context switches process `pid` has made so far, all its threads together: each time one
/// of them went to sleep (waiting for I/O, a lock or work) or was preempted, from each thread's
/// `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches`. Like [`cpu_time`], threads that
/// already exited are not counted.
pub(crate) fn context_switches(pid: u32) -> io::Result<u64> {
    sum_over_threads(pid, thread_context_switches)
}

/// `read` of each thread of process `pid` (its `/proc/<pid>/task/<tid>` directory), summed. A
/// thread that exits between the listing and its reading is skipped.
fn sum_over_threads<T: std::iter::Sum<T>>(
    pid: u32,
    read: fn(&Path) -> io::Result<T>,
) -> io::Result<T> {
    let mut readings = Vec::new();
    for task in fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Ok(reading) = read(&task?.path()) {
            readings.push(reading);
        }
    }
    if readings.is_empty() {
        return Err(io::Error::other(format!(
            "no readable threads in /proc/{pid}"
        )));
    }
    Ok(readings.into_iter().sum())
}

fn thread_context_switches(task: &Path) -> io::Result<u64> {
    let status = fs::read_to_string(task.join("status"))?;
    let count = |field: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    match (
        count("voluntary_ctxt_switches:"),
        count("nonvoluntary_ctxt_switches:"),
    ) {
        (Some(voluntary), Some(involuntary)) => Ok(voluntary + involuntary),
        _ => Err(io::Error::other("no context switch counts in status")),
    }
}

fn thread_cpu_time(task: &Path) -> io::Result<Duration> {
    if let Ok(schedstat) = fs::read_to_string(task.join("schedstat"))
        && let Some(ns) = schedstat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
    {
        return Ok(Duration::from_nanos(ns));
    }
    let stat = fs::read_to_string(task.join("stat"))?;
    // The command name (field 2) may hold spaces; fields are counted after its closing paren.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the paren.
    let ticks = |i: usize| fields.get(i).and_then(|t| t.parse::<u64>().ok());
    match (ticks(11), ticks(12)) {
        // USER_HZ is 100 on every Linux architecture that exposes it to user space.
        (Some(user), Some(system)) => Ok(Duration::from_millis((user + system) * 10)),
        _ => Err(io::Error::other("malformed stat")),
    }
}

/// Reads completed and bytes read by the machine's disks so far (`/proc/diskstats`, whole
/// devices: `/sys/block` entries other than loop, RAM and zram devices).
pub(crate) fn disk_reads() -> Option<(u64, u64)> {
    let stats = fs::read_to_string("/proc/diskstats").ok()?;
    let mut total = (0, 0);
    for line in stats.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(name) = fields.get(2) else { continue };
        let whole = Path::new("/sys/block").join(name).exists();
        if !whole || ["loop", "ram", "zram"].iter().any(|p| name.starts_with(p)) {
            continue;
        }
        // Fields 4 and 6 (1-based): reads completed, sectors read (512 bytes).
        let reads: u64 = fields.get(3)?.parse().ok()?;
        let sectors: u64 = fields.get(5)?.parse().ok()?;
        total.0 += reads;
        total.1 += sectors * 512;
    }
    Some(total)
}

/// Whether `pid` is a local PostgreSQL process (its backends are named `postgres`).
pub(crate) fn is_postgres(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "postgres")
}

/// Whether process `pid` exists on this machine.
pub(crate) fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The machine the numbers come from, for the report's header.
#[derive(Debug, Clone)]
pub(crate) struct Machine {
    /// Cores this process may run on.
    pub(crate) cores: usize,
    pub(crate) cpu_model: Option<String>,
    pub(crate) memory_bytes: Option<u64>,
    pub(crate) kernel: Option<String>,
    pub(crate) load_average: Option<String>,
}

impl Machine {
    pub(crate) fn detect() -> Self {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Self {
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model: cpuinfo
                .lines()
                .find_map(|line| line.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, model)| model.trim().to_owned()),
            memory_bytes: meminfo
                .lines()
                .find_map(|line| line.strip_prefix("MemTotal:"))
                .and_then(|value| value.trim().strip_suffix("kB"))
                .and_then(|kib| kib.trim().parse::<u64>().ok())
                .map(|kib| kib * 1024),
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
                .ok()
                .map(|release| release.trim().to_owned()),
            load_average: load_average(),
        }
    }
}

/// The 1, 5 and 15 minute load averages, as the kernel prints them.
pub(crate) fn load_average() -> Option<String> {
    let loadavg = fs::read_to_string("/proc/loadavg").ok()?;
    let fields: Vec<&str> = loadavg.split_whitespace().take(3).collect();
    (fields.len() == 3).then(|| fields.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let pid = std::process::id();
        assert!(peak_rss(pid).unwrap() > 0);
        assert!(cpu_time(pid).is_ok());
        // A thread that sleeps is switched out, and counted; the process's count includes it.
        let this_thread = Path::new("/proc/thread-self");
        let before = thread_context_switches(this_thread).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        let after = thread_context_switches(this_thread).unwrap();
        assert!(after > before);
        assert!(context_switches(pid).unwrap() >= after);
        assert!(exists(pid));
        assert!(!is_postgres(pid));
        assert!(Machine::detect().cores >= 1);
        let _ = disk_reads();
    }
}
