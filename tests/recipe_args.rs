//! The launcher's recipes pass every path to the step binaries as one `--flag=value` argument, so
//! a value that starts with `-` or holds spaces, quotes or `$` reaches the step intact and is
//! never taken for a flag.

use clap::Parser;
use std::path::Path;
use std::process::Command;

/// Runs `recipe` with a stand-in for the step binary that prints each argument it gets on a
/// line of its own, and returns those arguments.
fn recipe_argv(recipe: &str, step_binary: &str, args: &[&str]) -> Vec<String> {
    recipe_argv_with(recipe, step_binary, args, &[])
}

/// [`recipe_argv`] with `env` set for the recipe.
fn recipe_argv_with(recipe: &str, step_binary: &str, args: &[&str], env: &[(&str, &str)]) -> Vec<String> {
    let out = recipe_run(recipe, step_binary, args, env);
    assert!(out.status.success(), "{recipe}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
}

/// What `recipe` (with `env`) did, its step binary being the stand-in of [`recipe_argv`].
fn recipe_run(recipe: &str, step_binary: &str, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join(step_binary);
    std::fs::write(&fake, "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = std::env::join_paths(
        std::iter::once(dir.path().to_path_buf()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/recipes").join(recipe);
    Command::new("bash").arg(script).args(args).env("PATH", path).envs(env.iter().copied()).output().unwrap()
}

/// `train` passes '' for a ZeRO stage the user did not give (e2e_rlhf.py's convention): each
/// recipe then applies its own default, DS-Chat's (0 on one GPU, 2 on several; the reward
/// model 0), and a given stage is passed through.
#[test]
fn an_empty_zero_stage_is_the_recipes_default() {
    let stage = |argv: &[String], flag: &str| argv.iter().find_map(|a| a.strip_prefix(flag).map(str::to_string));
    for (recipe, step, want) in [
        ("step1_sft/single_gpu.sh", "sft", "0"),
        ("step1_sft/single_node.sh", "sft", "2"),
        ("step1_sft/multi_node.sh", "sft", "2"),
        ("step2_reward/single_node.sh", "reward", "0"),
    ] {
        let argv = recipe_argv(recipe, step, &["out", "", "m", "tiny"]);
        assert_eq!(stage(&argv, "--zero-stage=").as_deref(), Some(want), "{recipe}: {argv:?}");
        let argv = recipe_argv(recipe, step, &["out", "3", "m", "tiny"]);
        assert_eq!(stage(&argv, "--zero-stage=").as_deref(), Some("3"), "{recipe}: {argv:?}");
    }
    for (recipe, want) in [("step3_ppo/single_gpu.sh", "0"), ("step3_ppo/single_node.sh", "2")] {
        let argv = recipe_argv(recipe, "ppo", &["out", "", "a", "tiny", "c", ""]);
        assert_eq!(stage(&argv, "--actor-zero-stage=").as_deref(), Some(want), "{recipe}: {argv:?}");
        assert_eq!(stage(&argv, "--critic-zero-stage=").as_deref(), Some(want), "{recipe}: {argv:?}");
    }
}

#[test]
fn paths_that_look_like_flags_reach_the_steps_intact() {
    let output = "-o ut/it's a \"dir\" $HOME";
    for recipe in ["step1_sft/single_gpu.sh", "step1_sft/single_node.sh", "step1_sft/multi_node.sh"] {
        let argv = recipe_argv(recipe, "sft", &[output, "0", "-model", "tiny"]);
        assert!(argv.contains(&format!("--output-dir={output}")), "{recipe}: {argv:?}");
        assert!(argv.contains(&"--model-name-or-path=-model".to_string()), "{recipe}: {argv:?}");
        assert!(argv.contains(&"--data-output-path=-o ut/data_files".to_string()), "{recipe}: {argv:?}");
        // And the step's parser takes the values as values.
        let parsed = sft::args::SftArgs::try_parse_from(std::iter::once("sft".to_string()).chain(argv)).unwrap();
        assert_eq!(parsed.output_dir, Path::new(output));
    }
    for recipe in ["step2_reward/single_gpu.sh", "step2_reward/single_node.sh", "step2_reward/multi_node.sh"] {
        let argv = recipe_argv(recipe, "reward", &[output, "0", "-model", "tiny"]);
        assert!(argv.contains(&format!("--output-dir={output}")), "{recipe}: {argv:?}");
        assert!(argv.contains(&"--model-name-or-path=-model".to_string()), "{recipe}: {argv:?}");
    }
    for recipe in ["step3_ppo/single_gpu.sh", "step3_ppo/single_node.sh", "step3_ppo/multi_node.sh"] {
        let argv = recipe_argv(recipe, "ppo", &[output, "0", "-actor", "tiny", "-critic dir", "0"]);
        assert!(argv.contains(&format!("--output-dir={output}")), "{recipe}: {argv:?}");
        assert!(argv.contains(&"--actor-model-name-or-path=-actor".to_string()), "{recipe}: {argv:?}");
        assert!(argv.contains(&"--critic-model-name-or-path=-critic dir".to_string()), "{recipe}: {argv:?}");
    }
}

/// `train --algorithm` reaches step 3's recipes as RLHF_ALGORITHM: for every deployment and
/// model size, PPO gets the critic's flags, GRPO and RLOO get their answers per prompt, and they
/// and REINFORCE++ none of the critic's flags (which `ppo` refuses without a critic): the step accepts what the
/// recipe gives it. DPO's step-2 recipes give `reward` a DPO run it accepts.
#[test]
fn every_algorithm_gets_arguments_its_step_accepts() {
    for deployment in ["single_gpu", "single_node", "multi_node", "demo"] {
        let recipe = format!("step3_ppo/{deployment}.sh");
        let sizes: &[&str] = if deployment == "demo" { &["tiny"] } else { &["tiny", "gpt2-xl"] };
        for &size in sizes {
            for algorithm in ["ppo", "grpo", "rloo", "reinforce_pp"] {
                let args = ["out/step3", "2", "out/actor", size, "out/reward", "2"];
                let argv = recipe_argv_with(&recipe, "ppo", &args, &[("RLHF_ALGORITHM", algorithm)]);
                let parsed = ppo::PpoArgs::try_parse_from(std::iter::once("ppo".to_string()).chain(argv.clone()))
                    .unwrap_or_else(|e| panic!("{recipe} {size} {algorithm}: {e}"));
                parsed.validate().unwrap_or_else(|e| panic!("{recipe} {size} {algorithm}: {e:#}"));
                assert_eq!(parsed.algorithm.name(), algorithm, "{recipe} {size}: {argv:?}");
                let critic = argv.iter().any(|a| a.starts_with("--critic-learning-rate"));
                assert_eq!(critic, algorithm == "ppo", "{recipe} {size} {algorithm}: {argv:?}");
                if algorithm == "grpo" || algorithm == "rloo" {
                    assert!(parsed.num_samples_per_prompt >= 2, "{recipe} {size} {algorithm}: {argv:?}");
                }
                if size == "tiny" {
                    // The demo's passes over the prompts (docs/RLHF-INVESTIGATION.md, section 10).
                    let passes = match algorithm {
                        "ppo" | "reinforce_pp" => 3,
                        "grpo" => 1,
                        _ => 2,
                    };
                    assert_eq!(parsed.num_train_epochs, passes, "{recipe} {algorithm}: {argv:?}");
                }
            }
        }
        let recipe = format!("step2_dpo/{deployment}.sh");
        for &size in sizes {
            let argv = recipe_argv(&recipe, "reward", &["out/dpo", "0", "out/actor", size]);
            let parsed = reward::RewardArgs::try_parse_from(std::iter::once("reward".to_string()).chain(argv.clone()))
                .unwrap_or_else(|e| panic!("{recipe} {size}: {e}"));
            assert_eq!(parsed.algorithm, reward::args::Step2Algorithm::Dpo, "{recipe}: {argv:?}");
            parsed.refuse_other_algorithms_flags().unwrap();
            assert!(argv.contains(&"--model-name-or-path=out/actor".to_string()), "{recipe}: {argv:?}");
        }
    }
}

/// The arithmetic task's recipes (docs/RLHF-INVESTIGATION.md, section 18b) give their steps
/// arguments they accept: SFT over the prompt on the task, then GRPO on the rule reward alone,
/// scored on the held-out phrasings.
#[test]
fn the_arithmetic_recipes_get_arguments_their_steps_accept() {
    let argv = recipe_argv("step1_sft/arithmetic.sh", "sft", &["out/actor", "0", "tiny"]);
    let sft = sft::args::SftArgs::try_parse_from(std::iter::once("sft".to_string()).chain(argv.clone()))
        .unwrap_or_else(|e| panic!("step1_sft/arithmetic.sh: {e}"));
    assert!(sft.train_on_prompt, "{argv:?}");
    assert_eq!(sft.eval_prompts.as_deref(), Some("arithmetic-phrasings"), "{argv:?}");
    assert!(argv.contains(&"arithmetic".to_string()), "{argv:?}");
    let argv = recipe_argv("step3_ppo/arithmetic.sh", "ppo", &["out/step3", "0", "out/actor"]);
    let ppo = ppo::PpoArgs::try_parse_from(std::iter::once("ppo".to_string()).chain(argv.clone()))
        .unwrap_or_else(|e| panic!("step3_ppo/arithmetic.sh: {e}"));
    ppo.validate().unwrap_or_else(|e| panic!("step3_ppo/arithmetic.sh: {e:#}"));
    assert_eq!(ppo.algorithm.name(), "grpo", "{argv:?}");
    assert!(ppo.no_reward_model && ppo.num_samples_per_prompt >= 2, "{argv:?}");
    assert_eq!(ppo.eval_prompts.as_deref(), Some("arithmetic-phrasings"), "{argv:?}");
    assert!(argv.contains(&"--actor-model-name-or-path=out/actor".to_string()), "{argv:?}");
}

/// `train --task arithmetic` runs the arithmetic recipes with its own arguments (output, '' for
/// the ZeRO stage not given, model, size) and its algorithm in RLHF_ALGORITHM: GRPO unless told,
/// RLOO and REINFORCE++ without a critic; PPO (its critic would start from a reward model) is
/// refused by the recipe as by `train`.
#[test]
fn the_arithmetic_recipes_take_the_launchers_arguments_and_algorithms() {
    let argv = recipe_argv("step1_sft/arithmetic.sh", "sft", &["out/actor", "", "tiny", "tiny"]);
    let sft = sft::args::SftArgs::try_parse_from(std::iter::once("sft".to_string()).chain(argv.clone())).unwrap();
    assert!(argv.contains(&"--zero-stage=0".to_string()) && argv.contains(&"--model-name-or-path=tiny".to_string()));
    assert_eq!(sft.output_dir, Path::new("out/actor"));
    let launcher = ["out/step3", "", "out/actor", "tiny"];
    let unset = recipe_argv("step3_ppo/arithmetic.sh", "ppo", &launcher);
    for (algorithm, passes) in [("grpo", 1), ("rloo", 1), ("reinforce_pp", 4)] {
        let argv = recipe_argv_with("step3_ppo/arithmetic.sh", "ppo", &launcher, &[("RLHF_ALGORITHM", algorithm)]);
        let ppo = ppo::PpoArgs::try_parse_from(std::iter::once("ppo".to_string()).chain(argv.clone()))
            .unwrap_or_else(|e| panic!("{algorithm}: {e}"));
        ppo.validate().unwrap_or_else(|e| panic!("{algorithm}: {e:#}"));
        assert_eq!((ppo.algorithm.name(), ppo.num_train_epochs), (algorithm, passes), "{argv:?}");
        assert!(!ppo.algorithm.has_critic() && ppo.no_reward_model && ppo.actor_zero_stage == 0, "{argv:?}");
        assert_eq!(ppo.reward_fn.iter().map(|f| f.to_string()).collect::<Vec<_>>(), ["builtin:arithmetic"]);
        if algorithm == "grpo" {
            assert_eq!(argv, unset, "GRPO unless told");
        }
    }
    for algorithm in ["ppo", "dpo"] {
        let out = recipe_run("step3_ppo/arithmetic.sh", "ppo", &launcher, &[("RLHF_ALGORITHM", algorithm)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{algorithm}: {stderr}");
        assert!(stderr.contains(algorithm) && stderr.contains("grpo, rloo, reinforce_pp"), "{stderr}");
    }
}

/// The tasks' recipes (the capitals demo's, the arithmetic task's) give every deployment the
/// one-process run's global batches: on N data-parallel ranks each takes 1/N of every batch,
/// and every other argument is the same.
#[test]
fn the_tasks_split_their_batches_over_the_data_parallel_ranks() {
    let per_device = |argv: &[String], flag: &str| -> usize {
        let at = argv.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{flag} in {argv:?}"));
        argv[at + 1].parse().unwrap()
    };
    // Each step's per-device batch flags.
    const TRAIN_AND_EVAL: [&str; 2] = ["--per-device-train-batch-size", "--per-device-eval-batch-size"];
    const GENERATION_AND_TRAINING: [&str; 2] =
        ["--per-device-generation-batch-size", "--per-device-training-batch-size"];
    let steps = [
        ("step1_sft/demo.sh", "sft", vec!["out/actor", "", "tiny", "tiny"], TRAIN_AND_EVAL),
        ("step2_reward/demo.sh", "reward", vec!["out/reward", "", "out/actor", "tiny"], TRAIN_AND_EVAL),
        ("step2_dpo/demo.sh", "reward", vec!["out/dpo", "", "out/actor", "tiny"], TRAIN_AND_EVAL),
        (
            "step3_ppo/demo.sh",
            "ppo",
            vec!["out/step3", "", "out/actor", "tiny", "out/reward", ""],
            GENERATION_AND_TRAINING,
        ),
        // The arithmetic task's recipes, with the launcher's arguments.
        ("step1_sft/arithmetic.sh", "sft", vec!["out/actor", "", "tiny", "tiny"], TRAIN_AND_EVAL),
        ("step3_ppo/arithmetic.sh", "ppo", vec!["out/step3", "", "out/actor", "tiny"], GENERATION_AND_TRAINING),
    ];
    for (recipe, step, args, batch_flags) in steps {
        let one = recipe_argv_with(recipe, step, &args, &[("RLHF_DATA_PARALLEL_SIZE", "1")]);
        let four = recipe_argv_with(recipe, step, &args, &[("RLHF_DATA_PARALLEL_SIZE", "4")]);
        assert_eq!(one, recipe_argv(recipe, step, &args), "{recipe}: one rank unless told");
        for flag in &batch_flags {
            assert_eq!(per_device(&one, flag), 4 * per_device(&four, flag), "{recipe} {flag}");
        }
        let others = |argv: &[String]| -> Vec<String> {
            let mut kept = Vec::new();
            let mut skip = false;
            for a in argv {
                if std::mem::take(&mut skip) {
                    continue;
                }
                skip = batch_flags.contains(&a.as_str());
                if !skip {
                    kept.push(a.clone());
                }
            }
            kept
        };
        assert_eq!(others(&one), others(&four), "{recipe}: only the per-device batches differ");
        // The stage is the user's, or 0: the demo's is the one-process run's.
        assert!(one.iter().any(|a| a.ends_with("zero-stage=0")), "{recipe}: {one:?}");
    }
}

/// `single_gpu.sh`'s `tiny` size is the demo in one process: for every step and algorithm it
/// gives its step the same settings as the demo's own recipe (the flags may come in another
/// order or repeat; what the step parses is the same).
#[test]
fn the_single_gpu_tiny_recipes_are_the_demos() {
    let parsed = |recipe: &str, args: &[&str], algorithm: &str| -> String {
        let argv = recipe_argv_with(recipe, "ppo", args, &[("RLHF_ALGORITHM", algorithm)]);
        let args = ppo::PpoArgs::try_parse_from(std::iter::once("ppo".to_string()).chain(argv))
            .unwrap_or_else(|e| panic!("{recipe} {algorithm}: {e}"));
        format!("{args:?}")
    };
    let args = ["out/step3", "0", "out/actor", "tiny", "out/reward", "0"];
    for algorithm in ["ppo", "grpo", "rloo", "reinforce_pp"] {
        assert_eq!(
            parsed("step3_ppo/single_gpu.sh", &args, algorithm),
            parsed("step3_ppo/demo.sh", &args, algorithm),
            "step 3, {algorithm}"
        );
    }
    let parsed = |recipe: &str, binary: &str, args: &[&str]| -> String {
        // A recipe may say something before it runs its step (step 2's demo names its start).
        let argv = recipe_argv(recipe, binary, args).into_iter().skip_while(|a| !a.starts_with("--"));
        let argv = std::iter::once(binary.to_string()).chain(argv);
        match binary {
            "sft" => format!("{:?}", sft::args::SftArgs::try_parse_from(argv).unwrap()),
            _ => format!("{:?}", reward::RewardArgs::try_parse_from(argv).unwrap()),
        }
    };
    for (step, binary, args) in [
        ("step1_sft", "sft", ["out/actor", "0", "tiny", "tiny"]),
        ("step2_reward", "reward", ["out/reward", "0", "out/actor", "tiny"]),
        ("step2_dpo", "reward", ["out/dpo", "0", "out/actor", "tiny"]),
    ] {
        let (one, demo) = (format!("{step}/single_gpu.sh"), format!("{step}/demo.sh"));
        assert_eq!(parsed(&one, binary, &args), parsed(&demo, binary, &args), "{step}");
    }
}
