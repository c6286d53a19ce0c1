//! Kev's CUDA sources: which file each module compiles, the headers prepended to it, and the
//! constants it shares with its launcher. Each constant has its one definition here and reaches
//! the kernel as a `-D` define of the same name, so the two sides cannot drift apart. Compiled without the `cuda`
//! feature too: the CPU tests check the sources, and the CPU code reads some constants.
// Without CUDA only the tests and a few constants are used.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

include!("catalog.rs");

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `name` is an identifier in `text` outside `//` comments.
    fn mentions(text: &str, name: &str) -> bool {
        text.lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .flat_map(|l| l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
            .any(|word| word == name)
    }

    fn defines_in(text: &str) -> Vec<&str> {
        text.lines()
            .filter_map(|l| l.trim_start().strip_prefix("#define "))
            .filter_map(|l| l.split(|c: char| c == '(' || c.is_whitespace()).next())
            .collect()
    }

    /// What the compiler sees: every shared constant comes once, as a `-D` define, and no header or
    /// source defines it again; every constant any source takes is given to each source that
    /// uses it; the L2 norm epsilon keeps its C spelling.
    #[test]
    fn each_constant_is_defined_once() {
        let every: Vec<&str> = ALL
            .iter()
            .flat_map(|s| s.defines.iter().map(|(n, _)| *n))
            .collect();
        for source in ALL {
            let text = source.text();
            let in_text = defines_in(&text);
            let given: Vec<&str> = source.defines.iter().map(|(n, _)| *n).collect();
            for name in &given {
                assert!(
                    !in_text.contains(name),
                    "{}: {name} is defined in the text and by -D",
                    source.file
                );
                assert!(
                    mentions(&text, name),
                    "{}: -D{name} is never used",
                    source.file
                );
            }
            for name in &every {
                assert!(
                    given.contains(name) || !mentions(&text, name) || in_text.contains(name),
                    "{}: uses {name} without its -D define",
                    source.file
                );
            }
            let options = source.define_options();
            assert_eq!(options.len(), given.len());
            assert!(options
                .iter()
                .all(|o| o.starts_with("-D") && o.contains('=')));
            assert!(text.starts_with(COMMON));
            assert_eq!(text.contains(MMA), source.tensor_cores, "{}", source.file);
            assert!(text.ends_with(source.body));
        }
        assert!(GDR_RECURRENT
            .define_options()
            .contains(&"-DL2NORM_EPS=1e-6f".to_string()));
        assert!(FLASH_ATTENTION
            .define_options()
            .contains(&"-DFLASH_SMEM=101632".to_string()));
    }

    /// Each module has its own name (candle caches functions by module name).
    #[test]
    fn module_names_differ() {
        for (i, a) in ALL.iter().enumerate() {
            for b in &ALL[i + 1..] {
                assert_ne!(a.module, b.module);
                assert_ne!(a.file, b.file);
            }
        }
    }
}
