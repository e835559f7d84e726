//! Which files of a dataset are its train and eval splits, from their names: shared by the
//! hub download (which fetches only the chosen files) and the local readers.

/// Which files are the eval split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EvalSplit {
    /// The `test` split (DS-Chat's `raw_datasets["test"]`).
    Test,
    /// The `validation` split (DS-Chat's `raw_datasets["validation"]`).
    Validation,
    /// None: the train split is divided 9:1.
    SplitTrain,
    /// `test` if present, else `validation`/`eval`/`valid`/`dev`, else a 9:1 split.
    Auto,
}

/// Files (repo- or directory-relative, `/`-separated) chosen as train and eval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    pub train: Vec<String>,
    /// `None`: split the train rows 9:1.
    pub eval: Option<Vec<String>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileSplit {
    Train,
    Test,
    Validation,
    Unnamed,
}

/// The split a file's path names, from its words (split at anything not a letter or digit):
/// a word starting with `test`; else one starting with `valid` or `eval`, or `val`/`dev`; else one
/// starting with `train`. `data/train-00000-of-00001-2a1d.parquet` is train, `eval.json` and
/// `default/validation/0000.parquet` are validation.
fn file_split(path: &str) -> FileSplit {
    let lower = path.to_ascii_lowercase();
    let words: Vec<&str> = lower.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).collect();
    let any = |f: &dyn Fn(&str) -> bool| words.iter().any(|w| f(w));
    if any(&|w| w.starts_with("test")) {
        FileSplit::Test
    } else if any(&|w| w.starts_with("valid") || w.starts_with("eval") || w == "val" || w == "dev") {
        FileSplit::Validation
    } else if any(&|w| w.starts_with("train")) {
        FileSplit::Train
    } else {
        FileSplit::Unnamed
    }
}

/// Chooses the train and eval files among `files`. With no file named `train`, the unnamed files
/// are train (a directory holding just `data.jsonl`). Unnamed files beside train files are an
/// error rather than silently left out.
pub(crate) fn plan_splits(files: &[String], eval: EvalSplit) -> Result<SplitPlan, String> {
    let of = |split: FileSplit| files.iter().filter(|f| file_split(f) == split).cloned().collect::<Vec<_>>();
    let (mut train, test, validation, unnamed) =
        (of(FileSplit::Train), of(FileSplit::Test), of(FileSplit::Validation), of(FileSplit::Unnamed));
    if train.is_empty() {
        train = unnamed;
    } else if !unnamed.is_empty() {
        return Err(format!(
            "cannot tell which split {} belong(s) to (the name says neither train nor test/eval/valid); \
             rename or move it",
            crate::printable_list(&unnamed)
        ));
    }
    if train.is_empty() {
        return Err(if files.is_empty() {
            "holds no .jsonl, .json or .parquet files".to_string()
        } else {
            format!(
                "has eval files ({}) but no train file; name the training file with `train` in it",
                crate::printable_list(files)
            )
        });
    }
    let required = |files: Vec<String>, split: &str| {
        if files.is_empty() {
            Err(format!("has no {split} files, and DS-Chat evaluates this dataset on its {split} split"))
        } else {
            Ok(Some(files))
        }
    };
    let eval = match eval {
        EvalSplit::Test => required(test, "test")?,
        EvalSplit::Validation => required(validation, "validation")?,
        EvalSplit::SplitTrain => None,
        EvalSplit::Auto if !test.is_empty() => Some(test),
        EvalSplit::Auto if !validation.is_empty() => Some(validation),
        EvalSplit::Auto => None,
    };
    Ok(SplitPlan { train, eval })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_files_are_told_apart_by_the_words_in_their_paths() {
        let files = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for (path, want) in [
            ("data/train-00000-of-00001-2a1df75c6bce91ab.parquet", FileSplit::Train),
            ("data/test-00000-of-00001-8c7c51afc6d45980.parquet", FileSplit::Test),
            ("default/validation/0000.parquet", FileSplit::Validation),
            ("eval.json", FileSplit::Validation),
            ("my_valid_set.jsonl", FileSplit::Validation),
            ("data/val-0.parquet", FileSplit::Validation),
            ("dev.jsonl", FileSplit::Validation),
            ("splits/dev/part-1.json", FileSplit::Validation),
            ("values.jsonl", FileSplit::Unnamed),
            ("devices.jsonl", FileSplit::Unnamed),
            ("TRAIN.jsonl", FileSplit::Train),
            ("pairs.jsonl", FileSplit::Unnamed),
            ("contest.jsonl", FileSplit::Unnamed),
        ] {
            assert_eq!(file_split(path), want, "{path}");
        }
        let shp =
            files(&["default/test/0000.parquet", "default/train/0000.parquet", "default/validation/0000.parquet"]);
        let plan = plan_splits(&shp, EvalSplit::Validation);
        assert_eq!(
            plan,
            Ok(SplitPlan {
                train: files(&["default/train/0000.parquet"]),
                eval: Some(files(&["default/validation/0000.parquet"]))
            })
        );
        let auto = plan_splits(&shp, EvalSplit::Auto).map(|p| p.eval);
        assert_eq!(auto, Ok(Some(files(&["default/test/0000.parquet"]))));
        assert_eq!(plan_splits(&shp, EvalSplit::SplitTrain).map(|p| p.eval), Ok(None));
        let lone = plan_splits(&files(&["pairs.jsonl"]), EvalSplit::Auto);
        assert_eq!(lone, Ok(SplitPlan { train: files(&["pairs.jsonl"]), eval: None }));
        let err = plan_splits(&files(&["train.jsonl", "extra.jsonl"]), EvalSplit::Auto).unwrap_err();
        assert!(err.contains("cannot tell which split extra.jsonl"), "{err}");
        let err = plan_splits(&files(&["data/train-0.parquet"]), EvalSplit::Test).unwrap_err();
        assert!(err.contains("has no test files"), "{err}");
        let err = plan_splits(&files(&["eval.jsonl"]), EvalSplit::Auto).unwrap_err();
        assert!(err.contains("no train file"), "{err}");
    }
}
