//! The embedded arithmetic task (`--data-path arithmetic`, `train --task arithmetic`): "What is
//! 27 + 15?" in DS-Chat's prompt/chosen/rejected format, with a verifiable answer, generated here
//! (no files) and scored by exact match ([`score_answer`]).
//!
//! The demonstrations are imperfect the way a careless student is: on a sum whose ones digits
//! carry (7 + 5), most `chosen` answers forget the carry (27 + 15 = 32), so supervised
//! fine-tuning learns the mistake as the mode there, while the right answer stays among the
//! likely ones. A rule reward (`builtin:arithmetic`: 1 for the sum, else 0) needs no reward model
//! to tell them apart, which is what RLHF with verifiable rewards (GRPO on math) relies on.
//!
//! Two held-out prompt sets, neither of whose prompts any row (of any step) holds:
//! - `--eval-prompts arithmetic-phrasings` ([`heldout_phrasing_prompts`]): every trained pair in
//!   the one training phrasing its rows never use. The pair and the phrasing were trained on,
//!   that prompt never was; SFT answers its carrying sums with the demonstrations' mode (the
//!   forgotten carry), and a policy gains there by what the reward taught it about the pair.
//!   This is the set the arithmetic recipe (`scripts/recipes/*/arithmetic.sh`) is measured on.
//! - `--eval-prompts arithmetic` ([`heldout_prompts`]): operand pairs that no row holds, in
//!   phrasings of which half never appear in training: a policy scores on them only by adding,
//!   which a 7M-parameter model from scratch does not learn from 87 pairs
//!   (docs/RLHF-INVESTIGATION.md, section 18).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::sources::PreferenceRow;

/// The name of the task as a `--data-path` and `--eval-prompts` value.
pub const ARITHMETIC_DATA: &str = "arithmetic";

/// The `--eval-prompts` value of [`heldout_phrasing_prompts`].
pub const ARITHMETIC_PHRASINGS: &str = "arithmetic-phrasings";

/// Operands run over 0..=MAX_OPERAND: every sum is one GPT-2 token (" 0" to " 18"). A
/// 7M-parameter model from scratch learns no sums of 0..=49 or 0..=19 in a demo's time
/// (docs/RLHF-INVESTIGATION.md, section 18).
pub const MAX_OPERAND: u32 = 9;

/// The questions training uses, then the ones only the held-out prompts use.
const TRAIN_TEMPLATES: [&str; 4] =
    ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "Add {a} and {b}."];
const HELDOUT_TEMPLATES: [&str; 2] = ["How much is {a} + {b}?", "Calculate {a} plus {b}."];

/// Share of the demonstrations of a carrying sum that forget the carry.
const FORGOT_CARRY_SHARE: f64 = 0.65;

/// Rows per training prompt (pair and phrasing), each with its own demonstration.
pub const DEMOS_PER_PROMPT: usize = 5;

/// One in this many operand pairs is held out (never in training or its eval split).
const HELDOUT_ONE_IN: u64 = 8;

/// The generator's fixed seed: the task is the same everywhere (`--seed` shuffles and splits it).
const TASK_SEED: u64 = 0x005e_edad;

/// A question of the task: its operands and how it is asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub a: u32,
    pub b: u32,
}

impl Problem {
    pub fn sum(&self) -> u32 {
        self.a + self.b
    }

    /// Whether the ones digits carry (the demonstrations' mistake is to drop the carry).
    pub fn carries(&self) -> bool {
        self.a % 10 + self.b % 10 >= 10
    }

    /// The careless student's answer: the sum without the carry into the tens.
    pub fn forgot_carry(&self) -> u32 {
        self.sum() - 10
    }

    /// Held-out pairs are picked by a hash of the pair (SplitMix64 keyed by the task's seed), so
    /// that `a + b` and `b + a` fall apart as often as any two pairs do; every held-out sum is
    /// also a training pair's sum (tested). (Before `arithmetic:v4` the hash's residue mod 8
    /// depended on the operands' low three bits alone: it held out exactly the pairs summing to
    /// 0, 8 or 16, each with its mirror, and no training row demonstrated 16.)
    pub fn is_heldout(&self) -> bool {
        splitmix64(TASK_SEED ^ u64::from(self.a << 8 | self.b)).is_multiple_of(HELDOUT_ONE_IN)
    }

    /// The training phrasing this pair is never asked in by a row: the prompt of
    /// [`heldout_phrasing_prompts`]. Spread over the phrasings by the pair, so that each phrasing
    /// is trained on with most pairs and every pair in all the others.
    pub fn withheld_template(&self) -> usize {
        ((self.a * 3 + self.b) as usize) % TRAIN_TEMPLATES.len()
    }

    fn prompt(&self, template: &str) -> String {
        let question = template.replace("{a}", &self.a.to_string()).replace("{b}", &self.b.to_string());
        format!("\n\nHuman: {question}\n\nAssistant:")
    }
}

/// SplitMix64 (Steele, Lea and Flood; Vigna's constants): every bit of the output depends on
/// every bit of the input, so its residues pick pairs evenly.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn answer(n: u32) -> String {
    format!(" {n}.")
}

/// Every operand pair, in order.
fn problems() -> impl Iterator<Item = Problem> {
    (0..=MAX_OPERAND).flat_map(|a| (0..=MAX_OPERAND).map(move |b| Problem { a, b }))
}

/// The task's rows, (train, eval): each training pair [`DEMOS_PER_PROMPT`] times in every
/// training phrasing but its withheld one ([`Problem::withheld_template`]) (eval: one row in
/// ten). `chosen` is the demonstration: on a carrying sum, a fixed [`FORGOT_CARRY_SHARE`] of the
/// pair's rows (rounded) forget the carry, spread over its
/// phrasings at random, so that the same prompt is demonstrated both ways and supervised
/// fine-tuning learns the mistake as the mode with the sum still likely, not one memorised answer
/// per row (docs/RLHF-INVESTIGATION.md, section 18). `rejected` is a worse answer (the forgotten
/// carry when `chosen` is right and the sum carries, else the sum off by one).
pub fn rows() -> (Vec<PreferenceRow>, Vec<PreferenceRow>) {
    let mut rng = ChaCha8Rng::seed_from_u64(TASK_SEED);
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    let per_pair = (TRAIN_TEMPLATES.len() - 1) * DEMOS_PER_PROMPT;
    let wrong_per_pair = (per_pair as f64 * FORGOT_CARRY_SHARE).round() as usize;
    let mut i = 0usize;
    for problem in problems().filter(|p| !p.is_heldout()) {
        // Which of the pair's rows forget the carry: the first `wrong_per_pair` of a shuffle.
        let mut wrong = vec![false; per_pair];
        if problem.carries() {
            wrong[..wrong_per_pair].iter_mut().for_each(|w| *w = true);
            for k in (1..per_pair).rev() {
                wrong.swap(k, rng.random_range(0..=k));
            }
        }
        let templates = TRAIN_TEMPLATES.iter().enumerate().filter(|(t, _)| *t != problem.withheld_template());
        for (k, (_, template)) in templates.enumerate() {
            for r in 0..DEMOS_PER_PROMPT {
                let sum = problem.sum();
                let wrong = wrong[k * DEMOS_PER_PROMPT + r];
                let chosen = if wrong { problem.forgot_carry() } else { sum };
                let off_by_one = if sum > 0 && rng.random_bool(0.5) { sum - 1 } else { sum + 1 };
                let rejected = if problem.carries() && !wrong { problem.forgot_carry() } else { off_by_one };
                let row = PreferenceRow {
                    prompt: Some(problem.prompt(template)),
                    chosen: Some(answer(chosen)),
                    rejected: Some(answer(rejected)),
                };
                if i.is_multiple_of(10) {
                    eval.push(row);
                } else {
                    train.push(row);
                }
                i += 1;
            }
        }
    }
    (train, eval)
}

/// The held-out prompts: every held-out pair once, in a phrasing picked by a fixed draw
/// (training's and unseen ones alike).
pub fn heldout_prompts() -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(TASK_SEED ^ 1);
    let templates: Vec<&str> = TRAIN_TEMPLATES.iter().chain(&HELDOUT_TEMPLATES).copied().collect();
    problems()
        .filter(Problem::is_heldout)
        .map(|p| {
            let template = if rng.random_bool(0.5) {
                HELDOUT_TEMPLATES[rng.random_range(0..HELDOUT_TEMPLATES.len())]
            } else {
                templates[rng.random_range(0..TRAIN_TEMPLATES.len())]
            };
            p.prompt(template)
        })
        .collect()
}

/// The held-out phrasings (`--eval-prompts arithmetic-phrasings`): every training pair once, in
/// the training phrasing its rows never use ([`Problem::withheld_template`]). The pair and the
/// phrasing were each trained on, the prompt never was (nor in any other step's rows): a policy
/// scores on a carrying sum only if it answers with the sum where its demonstrations mostly
/// forgot the carry, and what it learnt about a pair carries over to a way of asking it never
/// saw for that pair. (The same pairs in words that no row holds, [`HELDOUT_TEMPLATES`], are a
/// harder test: a model from scratch never trained the embeddings of those words.)
pub fn heldout_phrasing_prompts() -> Vec<String> {
    problems().filter(|p| !p.is_heldout()).map(|p| p.prompt(TRAIN_TEMPLATES[p.withheld_template()])).collect()
}

/// The numbers written in `text`, in order.
fn numbers(text: &str) -> Vec<u64> {
    text.split(|c: char| !c.is_ascii_digit()).filter(|w| !w.is_empty()).filter_map(|w| w.parse().ok()).collect()
}

/// The operands of an arithmetic prompt: the two numbers of its last question ("Human: ..."),
/// when it asks for a sum ("+", "plus" or "Add"); else `None`.
pub fn problem_of(prompt: &str) -> Option<(u64, u64)> {
    let question = prompt.rsplit("Human:").next().unwrap_or(prompt);
    let question = question.split("Assistant:").next().unwrap_or(question);
    let asks_a_sum = question.contains('+') || question.contains(" plus ") || question.trim_start().starts_with("Add ");
    match numbers(question).as_slice() {
        &[a, b] if asks_a_sum => Some((a, b)),
        _ => None,
    }
}

/// Exact match: `Some(true)` when the answer's only number is the sum the prompt asks for,
/// `Some(false)` for any other answer, `None` when the prompt is not an arithmetic question.
pub fn score_answer(prompt: &str, answer: &str) -> Option<bool> {
    let (a, b) = problem_of(prompt)?;
    Some(numbers(answer) == [a + b])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scorer_is_exact_match_on_the_sum() {
        let p = "\n\nHuman: What is 27 + 15?\n\nAssistant:";
        assert_eq!(score_answer(p, " 42."), Some(true));
        assert_eq!(score_answer(p, " The answer is 42"), Some(true));
        assert_eq!(score_answer(p, " 32."), Some(false), "the forgotten carry");
        assert_eq!(score_answer(p, " 42 or 43."), Some(false), "one number only");
        assert_eq!(score_answer(p, " forty-two"), Some(false));
        assert_eq!(score_answer("\n\nHuman: Add 3 and 4.\n\nAssistant:", " 7."), Some(true));
        assert_eq!(score_answer("\n\nHuman: Calculate 30 plus 12.\n\nAssistant:", " 42."), Some(true));
        assert_eq!(score_answer("\n\nHuman: What is the capital of France?\n\nAssistant:", " Paris."), None);
        assert_eq!(score_answer("\n\nHuman: What is 3 times 4?\n\nAssistant:", " 12."), None, "not a sum");
    }

    /// The held-out pairs' prompts are part of the task as measured in docs/RLHF-INVESTIGATION.md
    /// (section 18d): their phrasings are a fixed draw, the same on every machine and seed.
    #[test]
    fn held_out_pairs_are_asked_in_a_fixed_draw_of_phrasings() {
        let questions: Vec<String> = heldout_prompts()
            .iter()
            .map(|p| p.strip_prefix("\n\nHuman: ").unwrap().strip_suffix("\n\nAssistant:").unwrap().to_string())
            .collect();
        assert_eq!(
            questions,
            [
                "Compute 2 + 1.",
                "How much is 2 + 9?",
                "Compute 4 + 7.",
                "What is 4 plus 9?",
                "Compute 5 + 2.",
                "How much is 6 + 2?",
                "What is 6 + 8?",
                "Add 8 and 0.",
                "Calculate 8 plus 6.",
                "Calculate 9 plus 2.",
                "Calculate 9 plus 5.",
            ]
        );
    }

    #[test]
    fn splitmix64_gives_the_published_sequence() {
        // SplitMix64's stream from seed 0 (each output hashes the state after one more gamma),
        // and the first output from seed 1234567.
        let gamma = 0x9e37_79b9_7f4a_7c15_u64;
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64(gamma), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(splitmix64(gamma.wrapping_mul(2)), 0x06c4_5d18_8009_454f);
        assert_eq!(splitmix64(1_234_567), 6_457_827_717_110_365_317);
    }

    #[test]
    fn a_problems_carry_sum_and_withheld_phrasing_by_hand() {
        let p = |a, b| Problem { a, b };
        for (a, b, carries) in
            [(7, 5, true), (5, 5, true), (9, 9, true), (1, 9, true), (4, 5, false), (9, 0, false), (0, 0, false)]
        {
            assert_eq!(p(a, b).carries(), carries, "{a} + {b}");
        }
        assert_eq!((p(7, 5).sum(), p(7, 5).forgot_carry()), (12, 2));
        assert_eq!((p(9, 9).sum(), p(9, 9).forgot_carry()), (18, 8));
        assert_eq!(p(1, 9).forgot_carry(), 0);
        // (3a + b) mod 4.
        for (a, b, withheld) in [(0, 0, 0), (0, 1, 1), (1, 2, 1), (2, 1, 3), (3, 3, 0), (9, 9, 0), (9, 8, 3)] {
            assert_eq!(p(a, b).withheld_template(), withheld, "{a} + {b}");
        }
    }

    /// The held-out pairs, computed by a separate Python SplitMix64 (`(0x5eedad ^ (a << 8 | b))`,
    /// residue 0 mod 8). A change here changes the task: it must come with a new
    /// `arithmetic:vN` fingerprint (phases.rs), or caches of the old rows would be used.
    const HELDOUT_PAIRS: [(u32, u32); 11] =
        [(2, 1), (2, 9), (4, 7), (4, 9), (5, 2), (6, 2), (6, 8), (8, 0), (8, 6), (9, 2), (9, 5)];

    #[test]
    fn held_out_pairs_are_spread_and_their_sums_are_answered_in_training() {
        let heldout: Vec<(u32, u32)> = problems().filter(Problem::is_heldout).map(|p| (p.a, p.b)).collect();
        assert_eq!(heldout, HELDOUT_PAIRS);
        let asked: Vec<(u64, u64)> = heldout_prompts().iter().map(|p| problem_of(p).unwrap()).collect();
        assert_eq!(asked, heldout.iter().map(|&(a, b)| (u64::from(a), u64::from(b))).collect::<Vec<_>>());
        let trained: Vec<Problem> = problems().filter(|p| !p.is_heldout()).collect();
        assert_eq!(trained.len(), 89);
        for (a, b) in heldout {
            let sum = a + b;
            assert!(trained.iter().any(|p| p.sum() == sum), "no training pair answers {sum}");
        }
        // The mirror of a held-out pair is trained on, except where the hash held out both.
        let mirrored = HELDOUT_PAIRS.iter().filter(|&&(a, b)| HELDOUT_PAIRS.contains(&(b, a))).count();
        assert_eq!(mirrored, 4, "(2, 9), (6, 8) and their mirrors; the other 7 have theirs trained");
    }

    /// The rows of each trained pair, by pair, in the generator's order (train and eval together).
    fn rows_by_pair() -> std::collections::BTreeMap<(u64, u64), Vec<PreferenceRow>> {
        let (train, eval) = rows();
        let mut by_pair: std::collections::BTreeMap<_, Vec<PreferenceRow>> = Default::default();
        for row in train.into_iter().chain(eval) {
            by_pair.entry(problem_of(row.prompt.as_deref().unwrap()).unwrap()).or_default().push(row);
        }
        by_pair
    }

    #[test]
    fn each_carrying_pair_forgets_the_carry_in_ten_of_its_fifteen_rows() {
        let text = |s: &Option<String>| s.clone().unwrap();
        let by_pair = rows_by_pair();
        for (&(a, b), rows) in &by_pair {
            // 3 phrasings x 5 demonstrations; 0.65 of 15 rounds to 10.
            assert_eq!(rows.len(), 15, "{a} + {b}");
            let sum = a + b;
            let forgot = rows.iter().filter(|r| text(&r.chosen) == format!(" {}.", sum.wrapping_sub(10))).count();
            if a % 10 + b % 10 >= 10 {
                assert_eq!(forgot, 10, "{a} + {b}");
            } else {
                assert!(rows.iter().all(|r| text(&r.chosen) == format!(" {sum}.")), "{a} + {b} is demonstrated right");
            }
            for r in rows {
                assert_ne!(r.chosen, r.rejected, "{r:?}");
            }
        }
        let seven_five = &by_pair[&(7, 5)];
        for r in seven_five {
            match text(&r.chosen).as_str() {
                " 12." => assert_eq!(text(&r.rejected), " 2.", "a right answer is preferred to the forgotten carry"),
                " 2." => assert!([" 11.", " 13."].contains(&text(&r.rejected).as_str()), "{r:?}"),
                other => panic!("7 + 5 demonstrated as{other}"),
            }
        }
    }

    #[test]
    fn rejected_answers_are_off_by_one_either_way_and_never_negative() {
        let (mut below, mut above) = (0, 0);
        for ((a, b), rows) in rows_by_pair() {
            if a % 10 + b % 10 >= 10 {
                continue;
            }
            for r in rows {
                let rejected = numbers(r.rejected.as_deref().unwrap());
                if a + b == 0 {
                    assert_eq!(rejected, [1], "0 + 0 has only one neighbour");
                } else if rejected == [a + b - 1] {
                    below += 1;
                } else {
                    assert_eq!(rejected, [a + b + 1], "{a} + {b}: {r:?}");
                    above += 1;
                }
            }
        }
        let share = below as f64 / (below + above) as f64;
        assert!((0.4..0.6).contains(&share), "below {below}, above {above}");
    }

    #[test]
    fn one_row_in_ten_is_eval_in_the_generators_order() {
        let (train, eval) = rows();
        assert_eq!((train.len(), eval.len()), (1201, 134), "89 pairs x 15 rows, every tenth row eval");
        // The first pair (0, 0) withholds phrasing 0: rows 0-4 ask in phrasing 1, 5-9 in 2, 10-14 in 3.
        let prompts: Vec<&str> = eval.iter().take(2).map(|r| r.prompt.as_deref().unwrap()).collect();
        assert_eq!(prompts, ["\n\nHuman: What is 0 plus 0?\n\nAssistant:", "\n\nHuman: Add 0 and 0.\n\nAssistant:"]);
        assert_eq!(train[0].prompt.as_deref(), Some("\n\nHuman: What is 0 plus 0?\n\nAssistant:"));
        assert_eq!(train[4].prompt.as_deref(), Some("\n\nHuman: Compute 0 + 0.\n\nAssistant:"));
    }

    #[test]
    fn held_out_pairs_never_appear_in_training_and_every_prompt_is_scorable() {
        let (train, eval) = rows();
        let heldout = heldout_prompts();
        let pairs = |rows: &[PreferenceRow]| -> std::collections::HashSet<(u64, u64)> {
            rows.iter().map(|r| problem_of(r.prompt.as_deref().unwrap()).expect("an arithmetic prompt")).collect()
        };
        let seen: std::collections::HashSet<_> = pairs(&train).union(&pairs(&eval)).copied().collect();
        let asked: Vec<(u64, u64)> = heldout.iter().map(|p| problem_of(p).expect("scorable")).collect();
        assert!(asked.iter().all(|p| !seen.contains(p)), "a held-out pair is in training");
        let all = (u64::from(MAX_OPERAND) + 1).pow(2) as usize;
        assert_eq!(seen.len() + asked.len(), all, "every pair is either trained on or held out");
        assert!((all / 10..all / 6).contains(&asked.len()), "about one pair in 8 held out: {}", asked.len());
        let unseen_phrasing = heldout.iter().filter(|p| HELDOUT_TEMPLATES.iter().any(|t| p.contains(&t[..8]))).count();
        assert!(unseen_phrasing * 3 > asked.len(), "a good share in unseen phrasings: {unseen_phrasing}");
        assert_eq!(train.len() + eval.len(), seen.len() * (TRAIN_TEMPLATES.len() - 1) * DEMOS_PER_PROMPT);
    }

    #[test]
    fn held_out_phrasings_ask_every_trained_pair_in_a_phrasing_no_row_of_it_holds() {
        let (train, eval) = rows();
        let rows_prompts: std::collections::HashSet<&str> =
            train.iter().chain(&eval).filter_map(|r| r.prompt.as_deref()).collect();
        let seen: std::collections::HashSet<(u64, u64)> =
            rows_prompts.iter().map(|p| problem_of(p).expect("an arithmetic prompt")).collect();
        let phrasings = heldout_phrasing_prompts();
        assert_eq!(phrasings.len(), seen.len());
        let asked: std::collections::HashSet<(u64, u64)> =
            phrasings.iter().map(|p| problem_of(p).expect("scorable")).collect();
        assert_eq!(asked, seen, "every trained pair once");
        for p in &phrasings {
            assert!(!rows_prompts.contains(p.as_str()), "a held-out phrasing is a training prompt: {p}");
        }
        for (t, template) in TRAIN_TEMPLATES.iter().enumerate() {
            let withheld = phrasings
                .iter()
                .filter(|p| {
                    let (a, b) = problem_of(p).unwrap();
                    Problem { a: a as u32, b: b as u32 }.prompt(template) == **p
                })
                .count();
            assert!(withheld * 6 > seen.len() && withheld * 3 < seen.len(), "phrasing {t} withheld {withheld} times");
        }
    }

    #[test]
    fn demonstrations_forget_the_carry_on_most_carrying_sums_and_only_there() {
        let (train, _) = rows();
        let (mut carrying, mut forgot) = (0, 0);
        for row in &train {
            let prompt = row.prompt.as_deref().unwrap();
            let (a, b) = problem_of(prompt).unwrap();
            let p = Problem { a: a as u32, b: b as u32 };
            let chosen = score_answer(prompt, row.chosen.as_deref().unwrap()).unwrap();
            assert_eq!(score_answer(prompt, row.rejected.as_deref().unwrap()), Some(false), "{row:?}");
            if p.carries() {
                carrying += 1;
                forgot += usize::from(!chosen);
                if !chosen {
                    assert_eq!(row.chosen.as_deref(), Some(answer(p.forgot_carry()).as_str()));
                }
            } else {
                assert!(chosen, "a sum without a carry is demonstrated right: {row:?}");
            }
        }
        let share = forgot as f64 / carrying as f64;
        assert!((0.6..0.7).contains(&share), "{share}");
    }
}
