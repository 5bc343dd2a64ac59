//! Critical events and kills go to the kernel log as well (`/dev/kmsg`) where the host's console
//! is kept outside it: on Google Compute Engine the serial port's output (`gcloud compute
//! instances get-serial-port-output`) keeps them when the VM hung or lost its disk's last writes,
//! the case the history cannot cover. `[history] kernel_log`: "auto" (on GCE only, told by the
//! DMI product name; no network probe), "on", "off".

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::config::OnGce;
use crate::sample::gce;

/// A kernel log record holds about 1 KiB; longer lines are cut (on a character boundary).
const MAX_LINE: usize = 900;

/// The kernel log, open for writing.
#[derive(Debug)]
pub struct KernelLog {
    file: File,
}

/// Where the host's identity and the kernel log are (the real ones, or a test's files).
pub struct Paths<'a> {
    pub dmi_product_name: &'a Path,
    pub kmsg: &'a Path,
}

impl Paths<'static> {
    /// This host's.
    pub fn real() -> Paths<'static> {
        Paths {
            dmi_product_name: Path::new(gce::DMI_PRODUCT_NAME),
            kmsg: Path::new("/dev/kmsg"),
        }
    }
}

impl KernelLog {
    /// The kernel log if `setting` asks for it here; `Err` says why it could not be opened.
    pub fn open(setting: OnGce, paths: &Paths) -> Result<Option<KernelLog>, String> {
        if !gce::wanted(setting, paths.dmi_product_name) {
            return Ok(None);
        }
        File::options()
            .append(true)
            .open(paths.kmsg)
            .map(|file| Some(KernelLog { file }))
            .map_err(|e| format!("cannot open {} for writing: {e}", paths.kmsg.display()))
    }

    /// One line at the critical level. Control characters (a process may name itself with a
    /// newline to forge a record) become `?`; a line too long is cut.
    pub fn critical(&self, text: &str) {
        let mut line = String::from("<2>gpuguard: ");
        for c in text.chars() {
            if line.len() + c.len_utf8() > MAX_LINE {
                line.push('…');
                break;
            }
            line.push(if c.is_control() { '?' } else { c });
        }
        line.push('\n');
        // One write, one record; a failure is not worth more than losing this copy.
        let _ = (&self.file).write_all(line.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_gce_by_default_and_only_there_unless_told() {
        let tmp = tempfile::tempdir().unwrap();
        let (dmi, kmsg) = (tmp.path().join("product_name"), tmp.path().join("kmsg"));
        std::fs::write(&kmsg, "").unwrap();
        let paths = Paths {
            dmi_product_name: &dmi,
            kmsg: &kmsg,
        };
        // No DMI at all (a container), or another cloud: off in auto.
        assert!(KernelLog::open(OnGce::Auto, &paths).unwrap().is_none());
        std::fs::write(&dmi, "Amazon EC2\n").unwrap();
        assert!(KernelLog::open(OnGce::Auto, &paths).unwrap().is_none());
        assert!(KernelLog::open(OnGce::On, &paths).unwrap().is_some());
        std::fs::write(&dmi, "Google Compute Engine\n").unwrap();
        assert!(KernelLog::open(OnGce::Off, &paths).unwrap().is_none());
        let log = KernelLog::open(OnGce::Auto, &paths)
            .unwrap()
            .expect("on GCE");
        log.critical("kill model 'qwen' pids [1234(vllm)]: RAM 0.9 GiB available");
        // A process named to forge a kernel log line of its own.
        log.critical("kill pid 66(x\n<0>kernel: forged)");
        log.critical(&"é".repeat(2000));
        let written = std::fs::read_to_string(&kmsg).unwrap();
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(lines.len(), 3, "{written}");
        assert_eq!(
            lines[0],
            "<2>gpuguard: kill model 'qwen' pids [1234(vllm)]: RAM 0.9 GiB available"
        );
        assert_eq!(lines[1], "<2>gpuguard: kill pid 66(x?<0>kernel: forged)");
        assert!(lines[2].len() <= MAX_LINE + 4 && lines[2].ends_with('…'));
        // Unwritable: said, not fatal.
        let missing = tmp.path().join("no/kmsg");
        let paths = Paths {
            dmi_product_name: &dmi,
            kmsg: &missing,
        };
        assert!(KernelLog::open(OnGce::Auto, &paths).is_err());
    }
}
