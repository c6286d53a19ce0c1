//! The checkpoint directory and its `kev.json` (docs/CONTRACT.md §4), and where the base files are.
//!
//! [`Checkpoint::open`] reads `kev.json`, resolves the base (a local folder, or `hf:<repo>[@rev]`
//! through the Hugging Face cache, offline only: this crate never downloads) and checks that every
//! file it names is there, so that a broken checkpoint fails at once with the missing path.
//! `kev.json` is checked field by field, so errors name the field (`head.dim`); unknown fields are
//! errors, as a misspelt key would otherwise be silently ignored.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::json::{self, fault, FieldResult};
use crate::template::Template;

/// The only `format` this runtime reads.
pub const FORMAT: &str = "kev/1";

/// The contents of `kev.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KevConfig {
    /// Always `"kev/1"`.
    pub format: String,
    /// The base model: a folder (relative to `kev.json` or absolute) or `hf:<repo>[@revision]`.
    pub base: String,
    /// The LoRA adapter folder relative to `kev.json` (or absolute), if any.
    #[serde(default)]
    pub adapter: Option<String>,
    /// The pointer head.
    pub head: HeadConfig,
    /// The prompt template and markers.
    pub template: Template,
    /// The most tokens a record may need (state plus longest branch). By default, 8192.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
}

/// The `head` section of `kev.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadConfig {
    /// The head's safetensors file, relative to `kev.json`.
    pub file: String,
    /// Query/key size of the pointer head (> 0).
    pub dim: usize,
    /// Softmax temperature, finite and > 0. By default, 1.0.
    #[serde(default = "default_temperature")]
    pub temperature: f64,
}

fn default_max_tokens() -> usize {
    8192
}

fn default_temperature() -> f64 {
    1.0
}

impl KevConfig {
    /// Reads and checks a `kev.json`.
    ///
    /// Errors: [`Error::Io`], [`Error::Json`] when it does not parse, [`Error::Config`] naming the
    /// field for a missing, unknown, ill-typed or out-of-range value.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and checks the text of a `kev.json`; `path` is named in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let value = json::parse_json_text(text, path)?;
        let config = parse_config(&value).map_err(|f| Error::config(path, f.field, f.message))?;
        config.template.validate(path)?;
        Ok(config)
    }

    /// The base model reference; relative folders are taken from `kev_dir` (the folder holding
    /// `kev.json`).
    pub fn base_ref(&self, kev_dir: &Path) -> Result<BaseRef> {
        BaseRef::parse(&self.base, kev_dir)
            .map_err(|message| Error::config(&kev_dir.join("kev.json"), "base", message))
    }
}

fn parse_config(value: &Value) -> FieldResult<KevConfig> {
    let obj = json::as_object(value, "")?;
    json::deny_unknown(
        obj,
        &[
            "format",
            "base",
            "adapter",
            "head",
            "template",
            "max_tokens",
        ],
        "",
    )?;
    let format = json::req_str(obj, "format", "")?;
    if format != FORMAT {
        return Err(fault(
            "format",
            format!("`{format}` is not supported: expected `{FORMAT}`"),
        ));
    }
    let base = json::req_str(obj, "base", "")?;
    if base.trim().is_empty() {
        return Err(fault("base", "must not be empty"));
    }
    let adapter = json::opt_str(obj, "adapter", "")?.map(str::to_owned);
    if adapter.as_deref().is_some_and(|a| a.trim().is_empty()) {
        return Err(fault(
            "adapter",
            "must not be empty (use null or leave it out for no adapter)",
        ));
    }
    let head = parse_head(required_object(obj, "head")?)?;
    let template = parse_template(required_object(obj, "template")?)?;
    let max_tokens = json::opt_usize(obj, "max_tokens", "")?.unwrap_or_else(default_max_tokens);
    if max_tokens == 0 {
        return Err(fault("max_tokens", "must be positive"));
    }
    Ok(KevConfig {
        format: format.to_owned(),
        base: base.to_owned(),
        adapter,
        head,
        template,
        max_tokens,
    })
}

fn required_object<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> FieldResult<&'a Map<String, Value>> {
    match obj.get(key) {
        None => Err(fault(key, "missing (an object is required)")),
        Some(v) => json::as_object(v, key),
    }
}

fn parse_head(obj: &Map<String, Value>) -> FieldResult<HeadConfig> {
    json::deny_unknown(obj, &["file", "dim", "temperature"], "head")?;
    let file = json::req_str(obj, "file", "head")?.to_owned();
    if file.is_empty() {
        return Err(fault("head.file", "must not be empty"));
    }
    let dim = match obj.get("dim") {
        None => {
            return Err(fault(
                "head.dim",
                "missing (a positive integer is required)",
            ))
        }
        Some(v) => json::as_usize(v, "head.dim")?,
    };
    if dim == 0 {
        return Err(fault("head.dim", "must be positive"));
    }
    let temperature =
        json::opt_f64(obj, "temperature", "head")?.unwrap_or_else(default_temperature);
    // The head divides f32 logits by it: its f32 value and its reciprocal must be normal numbers.
    let t32 = temperature as f32;
    if !(temperature > 0.0 && t32.is_normal() && (1.0 / t32).is_normal()) {
        return Err(fault(
            "head.temperature",
            format!(
                "must be > 0 and within f32's normal range ({:e} to {:e}), got {temperature}",
                1.0 / f32::MAX,
                f32::MAX
            ),
        ));
    }
    Ok(HeadConfig {
        file,
        dim,
        temperature,
    })
}

fn parse_template(obj: &Map<String, Value>) -> FieldResult<Template> {
    const FIELDS: &[&str] = &[
        "state",
        "question",
        "option",
        "option_marker",
        "decide_marker",
    ];
    json::deny_unknown(obj, FIELDS, "template")?;
    let get = |k: &str| json::req_str(obj, k, "template").map(str::to_owned);
    Ok(Template {
        state: get("state")?,
        question: get("question")?,
        option: get("option")?,
        option_marker: get("option_marker")?,
        decide_marker: get("decide_marker")?,
    })
}

/// Where the base model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseRef {
    /// A folder on disk (already joined to the `kev.json` folder when relative).
    Local(PathBuf),
    /// A Hugging Face Hub model, read from the local cache.
    Hub {
        /// `owner/name`.
        repo: String,
        /// Branch, tag or commit; `None` means `main`.
        revision: Option<String>,
    },
}

impl BaseRef {
    /// Parses `hf:<repo>[@revision]`, or else a folder taken relative to `kev_dir` unless absolute.
    /// `Err` is the message for the `base` field.
    pub fn parse(base: &str, kev_dir: &Path) -> std::result::Result<BaseRef, String> {
        let Some(spec) = base.strip_prefix("hf:") else {
            return Ok(BaseRef::Local(kev_dir.join(base)));
        };
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, rev)) => (repo, Some(rev)),
            None => (spec, None),
        };
        if repo.is_empty()
            || repo.starts_with('/')
            || repo.ends_with('/')
            || repo.contains(char::is_whitespace)
        {
            return Err(format!("`{base}`: expected `hf:<owner>/<name>[@revision]`"));
        }
        if revision.is_some_and(|r| r.is_empty() || r.contains(char::is_whitespace)) {
            return Err(format!("`{base}`: empty or invalid revision after `@`"));
        }
        Ok(BaseRef::Hub {
            repo: repo.to_owned(),
            revision: revision.map(str::to_owned),
        })
    }
}

impl std::fmt::Display for BaseRef {
    /// The folder, or `hf:<repo>[@revision]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BaseRef::Local(dir) => write!(f, "{}", dir.display()),
            BaseRef::Hub {
                repo,
                revision: None,
            } => write!(f, "hf:{repo}"),
            BaseRef::Hub {
                repo,
                revision: Some(r),
            } => write!(f, "hf:{repo}@{r}"),
        }
    }
}

/// The base model's files, all checked to exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseFiles {
    /// The folder holding them (for the Hub: the cached snapshot).
    pub dir: PathBuf,
    /// `config.json`.
    pub config: PathBuf,
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// The weight files: `model.safetensors`, or the shards of `model.safetensors.index.json`
    /// (deduplicated, sorted), or else every `*.safetensors` in the folder, sorted.
    pub weights: Vec<PathBuf>,
}

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

impl BaseFiles {
    /// Resolves a [`BaseRef`]: a local folder, or the Hugging Face cache (see
    /// [`BaseFiles::from_hub_cache`] and [`hub_cache_dir`]).
    pub fn resolve(base: &BaseRef) -> Result<BaseFiles> {
        match base {
            BaseRef::Local(dir) => BaseFiles::from_local(dir),
            BaseRef::Hub { repo, revision } => {
                let cache = hub_cache_dir().ok_or_else(|| Error::MissingFile {
                    path: PathBuf::from(format!("hf:{repo}")),
                    hint: "no Hugging Face cache folder: set `HF_HUB_CACHE` or `HF_HOME`"
                        .to_owned(),
                })?;
                BaseFiles::from_hub_cache(&cache, repo, revision.as_deref())
            }
        }
    }

    /// The files of a local base folder. A missing folder, `config.json`, `tokenizer.json`,
    /// shard or weights is an [`Error::MissingFile`]; an index that does not parse is an
    /// [`Error::Json`] or [`Error::Config`].
    pub fn from_local(dir: &Path) -> Result<BaseFiles> {
        if !dir.is_dir() {
            return Err(Error::MissingFile {
                path: dir.to_path_buf(),
                hint: "the `base` folder of kev.json must hold config.json, tokenizer.json and *.safetensors".to_owned(),
            });
        }
        let need = |name: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(Error::MissingFile {
                    path: p,
                    hint: format!("the base folder must hold `{name}`"),
                })
            }
        };
        let config = need("config.json")?;
        let tokenizer = need("tokenizer.json")?;
        let weights = if dir.join(SINGLE).is_file() {
            vec![dir.join(SINGLE)]
        } else if dir.join(INDEX).is_file() {
            shards_of(&dir.join(INDEX))?
                .iter()
                .map(|s| need(s))
                .collect::<Result<Vec<_>>>()?
        } else {
            let mut all = Vec::new();
            let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for entry in entries {
                let path = entry.map_err(|e| Error::io(dir, e))?.path();
                if path.is_file() && path.extension().is_some_and(|x| x == "safetensors") {
                    all.push(path);
                }
            }
            all.sort();
            all
        };
        if weights.is_empty() {
            return Err(Error::MissingFile {
                path: dir.join(SINGLE),
                hint: format!(
                    "no `*.safetensors` weights in the base folder `{}`",
                    dir.display()
                ),
            });
        }
        Ok(BaseFiles {
            dir: dir.to_path_buf(),
            config,
            tokenizer,
            weights,
        })
    }

    /// The files of `repo` at `revision` (by default `main`) in the Hugging Face cache folder
    /// `cache_dir` (the `hub` folder, holding `models--owner--name`). Never downloads: a file not
    /// in the cache is an [`Error::MissingFile`] whose hint gives the `hf download` command. A
    /// revision may be a branch, a tag or a commit hash.
    pub fn from_hub_cache(
        cache_dir: &Path,
        repo: &str,
        revision: Option<&str>,
    ) -> Result<BaseFiles> {
        let rev = revision.unwrap_or("main");
        let cache = hf_hub::Cache::new(cache_dir.to_path_buf());
        let hub_repo =
            hf_hub::Repo::with_revision(repo.to_owned(), hf_hub::RepoType::Model, rev.to_owned());
        let repo_dir = cache_dir.join(hub_repo.folder_name());
        // hf-hub reads `refs/<rev>` verbatim; also accept a ref file with a trailing newline, and
        // a commit hash, which has no `refs/` entry but names its snapshot folder.
        let commit = std::fs::read_to_string(repo_dir.join("refs").join(rev))
            .map(|c| c.trim().to_owned())
            .unwrap_or_else(|_| rev.to_owned());
        let snapshot = repo_dir.join("snapshots").join(commit);
        let cached = cache.repo(hub_repo);
        let get = |file: &str| -> Result<PathBuf> {
            cached
                .get(file)
                .or_else(|| {
                    let p = snapshot.join(file);
                    p.is_file().then_some(p)
                })
                .ok_or_else(|| {
                    let rev_arg = revision.map(|r| format!(" --revision {r}")).unwrap_or_default();
                    Error::MissingFile {
                        path: PathBuf::from(format!("hf:{repo}@{rev}/{file}")),
                        hint: format!(
                            "not in the Hugging Face cache `{}`; fetch it with `hf download {repo}{rev_arg}` (or `huggingface-cli download {repo}{rev_arg}`)",
                            cache_dir.display()
                        ),
                    }
                })
        };
        let config = get("config.json")?;
        let tokenizer = get("tokenizer.json")?;
        let weights = match get(SINGLE) {
            Ok(p) => vec![p],
            Err(single_missing) => match get(INDEX) {
                Ok(index) => shards_of(&index)?
                    .iter()
                    .map(|s| get(s))
                    .collect::<Result<Vec<_>>>()?,
                Err(_) => return Err(single_missing),
            },
        };
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(BaseFiles {
            dir,
            config,
            tokenizer,
            weights,
        })
    }
}

/// The Hugging Face hub cache folder, as the Python `huggingface_hub` finds it: `HF_HUB_CACHE`,
/// else `HF_HOME/hub`, else `~/.cache/huggingface/hub`. `None` when no home folder is known.
pub fn hub_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = var("HF_HUB_CACHE") {
        return Some(p);
    }
    if let Some(p) = var("HF_HOME") {
        return Some(p.join("hub"));
    }
    let home = var("HOME").or_else(|| var("USERPROFILE"))?;
    Some(home.join(".cache").join("huggingface").join("hub"))
}

/// The shard file names of a `model.safetensors.index.json`: the `weight_map` values, deduplicated
/// and sorted.
fn shards_of(index: &Path) -> Result<Vec<String>> {
    let value = json::read_json_file(index)?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::config(index, "weight_map", "missing or not an object"))?;
    let mut shards = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.is_empty() && !f.contains(['/', '\\']) && *f != "..")
            .ok_or_else(|| {
                Error::config(
                    index,
                    format!("weight_map.{tensor}"),
                    "must be a file name in the same folder",
                )
            })?;
        shards.push(file.to_owned());
    }
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        return Err(Error::config(index, "weight_map", "must not be empty"));
    }
    Ok(shards)
}

/// An opened checkpoint directory: its `kev.json` and every file it needs, checked to exist.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Its `kev.json`.
    pub config: KevConfig,
    /// The parsed `base`.
    pub base_ref: BaseRef,
    /// The base model's files.
    pub base: BaseFiles,
    /// The adapter folder (holding `adapter_config.json` and `adapter_model.safetensors`), if any.
    pub adapter_dir: Option<PathBuf>,
    /// The pointer head's safetensors file.
    pub head_path: PathBuf,
    /// The `tokenizer.json` to encode with: the checkpoint folder's own if it has one (a
    /// tokenizer with the marker tokens added), else the adapter folder's, else the base's.
    pub tokenizer: PathBuf,
}

impl Checkpoint {
    /// Opens a checkpoint folder: reads `dir/kev.json`, resolves the base, and checks that the
    /// adapter files and the head file exist ([`Error::MissingFile`] otherwise).
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref();
        let kev_json = dir.join("kev.json");
        if !kev_json.is_file() {
            return Err(Error::MissingFile {
                path: kev_json,
                hint: "a Kev checkpoint folder must hold `kev.json`".to_owned(),
            });
        }
        let config = KevConfig::load(&kev_json)?;
        let base_ref =
            BaseRef::parse(&config.base, dir).map_err(|m| Error::config(&kev_json, "base", m))?;
        let base = BaseFiles::resolve(&base_ref)?;
        let adapter_dir = match &config.adapter {
            None => None,
            Some(a) => {
                let adir = dir.join(a);
                for name in ["adapter_config.json", "adapter_model.safetensors"] {
                    let p = adir.join(name);
                    if !p.is_file() {
                        return Err(Error::MissingFile {
                            path: p,
                            hint: format!("`adapter` in kev.json names `{a}`, which must hold a PEFT `{name}`"),
                        });
                    }
                }
                Some(adir)
            }
        };
        let head_path = dir.join(&config.head.file);
        if !head_path.is_file() {
            return Err(Error::MissingFile {
                path: head_path,
                hint: "`head.file` in kev.json must name the pointer head's safetensors file"
                    .to_owned(),
            });
        }
        let tokenizer = [Some(dir.to_path_buf()), adapter_dir.clone()]
            .into_iter()
            .flatten()
            .map(|d| d.join("tokenizer.json"))
            .find(|p| p.is_file())
            .unwrap_or_else(|| base.tokenizer.clone());
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            base_ref,
            base,
            adapter_dir,
            head_path,
            tokenizer,
        })
    }

    /// `adapter_config.json` of the adapter, if any.
    pub fn adapter_config_path(&self) -> Option<PathBuf> {
        self.adapter_dir
            .as_ref()
            .map(|d| d.join("adapter_config.json"))
    }

    /// `adapter_model.safetensors` of the adapter, if any.
    pub fn adapter_weights_path(&self) -> Option<PathBuf> {
        self.adapter_dir
            .as_ref()
            .map(|d| d.join("adapter_model.safetensors"))
    }

    /// An [`crate::Encoder`] with the checkpoint's tokenizer, template and `max_tokens`.
    pub fn encoder(&self) -> Result<crate::encoding::Encoder> {
        crate::encoding::Encoder::from_file(
            &self.tokenizer,
            self.config.template.clone(),
            self.config.max_tokens,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh, unique folder under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "kev-core-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        fn write(&self, rel: &str, text: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, text).unwrap();
            p
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const KEV_JSON: &str = r#"{"format": "kev/1",
     "base": "base",
     "adapter": "adapter",
     "head": {"file": "head.safetensors", "dim": 256, "temperature": 1.0},
     "template": {"state": "<|im_start|>user\n{state}\n", "question": "{prompt}\n",
                  "option": "- {option}", "option_marker": "<|kev_option|>",
                  "decide_marker": "<|kev_decide|>"},
     "max_tokens": 8192}"#;

    fn parse(text: &str) -> Result<KevConfig> {
        KevConfig::from_json_str(text, Path::new("ck/kev.json"))
    }

    fn with(path: &[&str], value: Option<&str>) -> String {
        let mut v: Value = serde_json::from_str(KEV_JSON).unwrap();
        let mut obj = &mut v;
        for k in &path[..path.len() - 1] {
            obj = &mut obj[*k];
        }
        let last = path[path.len() - 1];
        match value {
            Some(x) => obj[last] = serde_json::from_str(x).unwrap(),
            None => {
                obj.as_object_mut().unwrap().remove(last);
            }
        }
        v.to_string()
    }

    fn config_field(r: Result<KevConfig>) -> String {
        match r {
            Err(e @ Error::Config { .. }) => {
                let msg = e.to_string();
                assert!(msg.starts_with("`ck/kev.json`: field `"), "{msg}");
                let Error::Config { field, .. } = e else {
                    unreachable!()
                };
                field
            }
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn parses_kev_md_example() {
        let c = parse(KEV_JSON).unwrap();
        assert_eq!(c.format, "kev/1");
        assert_eq!(c.adapter.as_deref(), Some("adapter"));
        assert_eq!(c.head.dim, 256);
        assert_eq!(c.template.option, "- {option}");
        assert_eq!(c.max_tokens, 8192);
        // The derived serde impls agree with the hand parser.
        let via_serde: KevConfig = serde_json::from_str(KEV_JSON).unwrap();
        assert_eq!(via_serde, c);
    }

    #[test]
    fn defaults() {
        let text = with(&["head", "temperature"], None);
        let mut v: Value = serde_json::from_str(&text).unwrap();
        v.as_object_mut().unwrap().remove("max_tokens");
        v.as_object_mut().unwrap().remove("adapter");
        let c = parse(&v.to_string()).unwrap();
        assert_eq!(
            (c.head.temperature, c.max_tokens, c.adapter),
            (1.0, 8192, None)
        );
        assert_eq!(
            parse(&with(&["adapter"], Some("null"))).unwrap().adapter,
            None
        );
    }

    #[test]
    fn duplicate_keys_refused_and_bom_accepted() {
        let dup = KEV_JSON.replacen(r#""dim": 256,"#, r#""dim": 256, "dim": 128,"#, 1);
        match parse(&dup) {
            Err(e @ Error::Json { .. }) => {
                let src = std::error::Error::source(&e).unwrap().to_string();
                assert!(src.contains("duplicate key `dim`"), "{src}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(parse(&format!("\u{feff}{KEV_JSON}")).unwrap().head.dim, 256);
    }

    #[test]
    fn not_json() {
        assert!(
            matches!(parse("{\"format\": "), Err(Error::Json { path, .. }) if path == Path::new("ck/kev.json"))
        );
    }

    #[test]
    fn field_errors() {
        let cases: &[(&[&str], Option<&str>, &str)] = &[
            (&["format"], Some(r#""kev/2""#), "format"),
            (&["format"], None, "format"),
            (&["base"], Some("3"), "base"),
            (&["base"], Some(r#""""#), "base"),
            (&["adapter"], Some("[]"), "adapter"),
            (&["head"], None, "head"),
            (&["head"], Some("1"), "head"),
            (&["head", "dim"], Some("0"), "head.dim"),
            (&["head", "dim"], Some("-3"), "head.dim"),
            (&["head", "dim"], None, "head.dim"),
            (&["head", "file"], None, "head.file"),
            (&["head", "temperature"], Some("0"), "head.temperature"),
            (&["head", "temperature"], Some("-1.5"), "head.temperature"),
            (&["head", "temperature"], Some("1e-300"), "head.temperature"),
            (&["head", "temperature"], Some("1e300"), "head.temperature"),
            (
                &["head", "temperature"],
                Some(r#""hot""#),
                "head.temperature",
            ),
            (&["head", "bias"], Some("true"), "head.bias"),
            (&["template", "option"], None, "template.option"),
            (
                &["template", "option"],
                Some(r#""{prompt}""#),
                "template.option",
            ),
            (
                &["template", "state"],
                Some(r#""{state""#),
                "template.state",
            ),
            (&["template", "extra"], Some(r#""x""#), "template.extra"),
            (&["max_tokens"], Some("0"), "max_tokens"),
            (&["max_tokens"], Some("1.5"), "max_tokens"),
            (&["version"], Some("1"), "version"),
        ];
        for (path, value, want) in cases {
            assert_eq!(
                config_field(parse(&with(path, *value))),
                *want,
                "{path:?} = {value:?}"
            );
        }
    }

    #[test]
    fn base_ref_parsing() {
        let kd = Path::new("/ck");
        assert_eq!(
            BaseRef::parse("base", kd).unwrap(),
            BaseRef::Local("/ck/base".into())
        );
        assert_eq!(
            BaseRef::parse("/abs/base", kd).unwrap(),
            BaseRef::Local("/abs/base".into())
        );
        assert_eq!(
            BaseRef::parse("hf:Qwen/Qwen3.5-0.8B", kd).unwrap(),
            BaseRef::Hub {
                repo: "Qwen/Qwen3.5-0.8B".into(),
                revision: None
            }
        );
        let r = BaseRef::parse("hf:Qwen/Qwen3.5-0.8B@v1.0", kd).unwrap();
        assert_eq!(
            r,
            BaseRef::Hub {
                repo: "Qwen/Qwen3.5-0.8B".into(),
                revision: Some("v1.0".into())
            }
        );
        assert_eq!(r.to_string(), "hf:Qwen/Qwen3.5-0.8B@v1.0");
        for bad in ["hf:", "hf:@main", "hf:a/b@", "hf:/x"] {
            assert!(BaseRef::parse(bad, kd).is_err(), "{bad}");
        }
    }

    #[test]
    fn local_base_single_file() {
        let t = TempDir::new("single");
        t.write("config.json", "{}");
        t.write("tokenizer.json", "{}");
        t.write("model.safetensors", "");
        t.write("other.safetensors", "");
        let b = BaseFiles::from_local(&t.0).unwrap();
        assert_eq!(b.weights, vec![t.0.join("model.safetensors")]);
        assert_eq!(b.config, t.0.join("config.json"));
        assert_eq!(b.tokenizer, t.0.join("tokenizer.json"));
    }

    #[test]
    fn local_base_index_shards() {
        let t = TempDir::new("index");
        t.write("config.json", "{}");
        t.write("tokenizer.json", "{}");
        t.write(
            INDEX,
            r#"{"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors",
                "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}"#,
        );
        t.write("model-00001-of-00002.safetensors", "");
        let e = BaseFiles::from_local(&t.0).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("model-00002-of-00002.safetensors")),
            "{e:?}"
        );
        t.write("model-00002-of-00002.safetensors", "");
        t.write("stray.safetensors", "");
        let b = BaseFiles::from_local(&t.0).unwrap();
        assert_eq!(
            b.weights,
            vec![
                t.0.join("model-00001-of-00002.safetensors"),
                t.0.join("model-00002-of-00002.safetensors")
            ]
        );
        t.write(INDEX, r#"{"weight_map": {"a": "../x.safetensors"}}"#);
        assert!(
            matches!(BaseFiles::from_local(&t.0), Err(Error::Config { field, .. }) if field == "weight_map.a")
        );
        t.write(INDEX, "{");
        assert!(matches!(
            BaseFiles::from_local(&t.0),
            Err(Error::Json { .. })
        ));
    }

    #[test]
    fn local_base_glob_and_missing_files() {
        let t = TempDir::new("glob");
        assert!(matches!(
            BaseFiles::from_local(&t.0.join("nope")),
            Err(Error::MissingFile { .. })
        ));
        let e = BaseFiles::from_local(&t.0).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("config.json")),
            "{e:?}"
        );
        t.write("config.json", "{}");
        let e = BaseFiles::from_local(&t.0).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("tokenizer.json")),
            "{e:?}"
        );
        t.write("tokenizer.json", "{}");
        assert!(matches!(
            BaseFiles::from_local(&t.0),
            Err(Error::MissingFile { .. })
        ));
        t.write("b.safetensors", "");
        t.write("a.safetensors", "");
        let b = BaseFiles::from_local(&t.0).unwrap();
        assert_eq!(
            b.weights,
            vec![t.0.join("a.safetensors"), t.0.join("b.safetensors")]
        );
    }

    #[test]
    fn hub_cache_lookup_is_offline() {
        let t = TempDir::new("hub");
        let repo_dir = "models--Org--Tiny";
        let commit = "0123456789abcdef0123456789abcdef01234567";
        t.write(&format!("{repo_dir}/refs/main"), commit);
        for f in ["config.json", "tokenizer.json", "model.safetensors"] {
            t.write(&format!("{repo_dir}/snapshots/{commit}/{f}"), "{}");
        }
        let snap = t.0.join(repo_dir).join("snapshots").join(commit);
        let b = BaseFiles::from_hub_cache(&t.0, "Org/Tiny", None).unwrap();
        assert_eq!(b.dir, snap);
        assert_eq!(b.weights, vec![snap.join("model.safetensors")]);
        // A commit hash as revision reads its snapshot directly.
        let b = BaseFiles::from_hub_cache(&t.0, "Org/Tiny", Some(commit)).unwrap();
        assert_eq!(b.config, snap.join("config.json"));
        // A revision not in the cache says how to get it.
        match BaseFiles::from_hub_cache(&t.0, "Org/Tiny", Some("v2")).unwrap_err() {
            Error::MissingFile { path, hint } => {
                assert_eq!(path, PathBuf::from("hf:Org/Tiny@v2/config.json"));
                assert!(
                    hint.contains("hf download Org/Tiny --revision v2"),
                    "{hint}"
                );
            }
            e => panic!("{e:?}"),
        }
        match BaseFiles::from_hub_cache(&t.0, "Org/Other", None).unwrap_err() {
            Error::MissingFile { hint, .. } => {
                assert!(hint.contains("hf download Org/Other`"), "{hint}")
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn hub_cache_sharded() {
        let t = TempDir::new("hubshard");
        let commit = "c0ffee";
        t.write("models--Org--Big/refs/main", commit);
        let snap = format!("models--Org--Big/snapshots/{commit}");
        t.write(&format!("{snap}/config.json"), "{}");
        t.write(&format!("{snap}/tokenizer.json"), "{}");
        t.write(
            &format!("{snap}/{INDEX}"),
            r#"{"weight_map": {"x": "s2.safetensors", "y": "s1.safetensors"}}"#,
        );
        t.write(&format!("{snap}/s1.safetensors"), "");
        let e = BaseFiles::from_hub_cache(&t.0, "Org/Big", None).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("s2.safetensors")),
            "{e:?}"
        );
        t.write(&format!("{snap}/s2.safetensors"), "");
        let b = BaseFiles::from_hub_cache(&t.0, "Org/Big", None).unwrap();
        let snap = t.0.join(snap);
        assert_eq!(
            b.weights,
            vec![snap.join("s1.safetensors"), snap.join("s2.safetensors")]
        );
    }

    fn checkpoint_dir(tag: &str) -> TempDir {
        let t = TempDir::new(tag);
        t.write("kev.json", KEV_JSON);
        t.write("head.safetensors", "");
        t.write("adapter/adapter_config.json", "{}");
        t.write("adapter/adapter_model.safetensors", "");
        t.write("base/config.json", "{}");
        t.write("base/tokenizer.json", "{}");
        t.write("base/model.safetensors", "");
        t
    }

    #[test]
    fn open_checkpoint() {
        let t = checkpoint_dir("open");
        let c = Checkpoint::open(&t.0).unwrap();
        assert_eq!(c.base_ref, BaseRef::Local(t.0.join("base")));
        assert_eq!(c.base.weights, vec![t.0.join("base/model.safetensors")]);
        assert_eq!(c.adapter_dir, Some(t.0.join("adapter")));
        assert_eq!(
            c.adapter_config_path(),
            Some(t.0.join("adapter/adapter_config.json"))
        );
        assert_eq!(c.head_path, t.0.join("head.safetensors"));
        assert_eq!(c.tokenizer, t.0.join("base/tokenizer.json"));
        // A tokenizer in the checkpoint folder wins over the base's.
        t.write("tokenizer.json", "{}");
        assert_eq!(
            Checkpoint::open(&t.0).unwrap().tokenizer,
            t.0.join("tokenizer.json")
        );
    }

    #[test]
    fn open_checkpoint_missing_files() {
        let t = checkpoint_dir("missing");
        std::fs::remove_file(t.0.join("adapter/adapter_model.safetensors")).unwrap();
        let e = Checkpoint::open(&t.0).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("adapter/adapter_model.safetensors")),
            "{e:?}"
        );
        t.write("kev.json", &with(&["adapter"], None));
        Checkpoint::open(&t.0).unwrap();
        std::fs::remove_file(t.0.join("head.safetensors")).unwrap();
        let e = Checkpoint::open(&t.0).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("head.safetensors")),
            "{e:?}"
        );
        let e = Checkpoint::open(t.0.join("nope")).unwrap_err();
        assert!(
            matches!(&e, Error::MissingFile { path, .. } if path.ends_with("kev.json")),
            "{e:?}"
        );
        t.write("kev.json", &with(&["base"], Some(r#""hf:""#)));
        assert!(
            matches!(Checkpoint::open(&t.0), Err(Error::Config { field, .. }) if field == "base")
        );
    }
}
