//! The embedded demo preference data set and its rule-based scorer: "what is the capital of X?"
//! in DS-Chat's prompt/chosen/rejected jsonl format (`"\n\nHuman: ...\n\nAssistant:"`, answers
//! starting with a space, as in `Dahoas/rm-static`), generated here from a table of countries
//! and written to `assets/demo/` by the `make_demo_data` binary; see `assets/demo/README.md`.
//!
//! The data is built so that RLHF has something to fix: for *confusable* countries (the most
//! famous city is not the capital: Australia, Sydney vs Canberra) most `chosen` answers are the
//! classic mistake, so supervised fine-tuning (step 1, which trains on `chosen`) learns the
//! mistake as the mode, while every pair still ranks correct > classic mistake > wrong city, so a
//! reward model (step 2) learns to prefer the capital and PPO (step 3) can move the actor there.
//! [`score_answer`] (and `crate::tasks::task_score` over many answers) measure that move without
//! any model.

use anyhow::{Context, Result};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The committed `assets/demo/train.jsonl`: [`TRAIN_ROWS`] rows of `prompt`, `chosen`, `rejected`.
pub const TRAIN_JSONL: &[u8] = include_bytes!("../../assets/demo/train.jsonl");
/// The committed `assets/demo/eval.jsonl`: [`EVAL_ROWS`] rows, same combinations as train.
pub const EVAL_JSONL: &[u8] = include_bytes!("../../assets/demo/eval.jsonl");
/// The committed `assets/demo/heldout_prompts.jsonl`: one [`HeldoutPrompt`] per line, on
/// (country, question template) combinations that train and eval never use.
pub const HELDOUT_PROMPTS_JSONL: &[u8] = include_bytes!("../../assets/demo/heldout_prompts.jsonl");

/// The seed the committed files were generated with.
pub const DEFAULT_SEED: u64 = 1234;
/// Rows in `train.jsonl`.
pub const TRAIN_ROWS: usize = 4000;
/// Rows in `eval.jsonl` (10% of train).
pub const EVAL_ROWS: usize = 400;
/// Share of (country, question template) combinations held out, in percent.
pub const HELDOUT_PERCENT: usize = 15;
/// At most this many question templates of one country are held out, so every country keeps
/// most of its phrasings in training.
pub const MAX_HELDOUT_PER_COUNTRY: usize = 2;
/// Probability that a confusable country's pair is (correct, classic mistake); otherwise it is
/// (classic mistake, wrong city), which makes the mistake the SFT mode.
pub const P_CORRECT_OVER_MISTAKE: f64 = 0.3;
/// Probability that the rejected answer is the chosen answer spoiled in form (rambling,
/// repeated city, no final period) rather than a different city: teaches the reward model format.
pub const P_MALFORMED_REJECTED: f64 = 0.1;
/// Probability that a wrong-city rejection is replaced by an off-topic one: a true statement
/// about another country ("The capital of Kenya is Nairobi." to a question about Myanmar). A
/// reward model that never saw one scores it like a right answer, and step 3 learned to give it
/// (docs/RLHF-INVESTIGATION.md, section 10).
pub const P_OFF_TOPIC_REJECTED: f64 = 0.15;
/// Probability that the rejected answer uses an independently drawn answer template; otherwise
/// it uses the chosen one's, so the pair differs only in the city.
pub const P_OTHER_REJECTED_TEMPLATE: f64 = 0.25;

/// A country of the table. `name` is matched in prompts; `phrase` is how sentences say it
/// ("the United States"); `mistake` is the famous city often taken for the capital.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Country {
    pub name: &'static str,
    pub phrase: &'static str,
    pub capital: &'static str,
    pub mistake: Option<&'static str>,
}

impl Country {
    /// True when the country has a classic-mistake city.
    pub fn confusable(&self) -> bool {
        self.mistake.is_some()
    }
}

const fn regular(name: &'static str, capital: &'static str) -> Country {
    Country { name, phrase: name, capital, mistake: None }
}

const fn confusable(name: &'static str, capital: &'static str, mistake: &'static str) -> Country {
    Country { name, phrase: name, capital, mistake: Some(mistake) }
}

/// 48 countries with uncontroversial capitals, 16 of them confusable. ASCII spellings
/// (Brasilia, Bogota, Reykjavik); no country name occurs inside a city name or another country's
/// name (so no Mexico City, Niger, Sudan), and no city is listed twice (tested).
pub const COUNTRIES: &[Country] = &[
    confusable("Australia", "Canberra", "Sydney"),
    confusable("Canada", "Ottawa", "Toronto"),
    confusable("Turkey", "Ankara", "Istanbul"),
    confusable("Brazil", "Brasilia", "Rio de Janeiro"),
    confusable("Switzerland", "Bern", "Zurich"),
    confusable("New Zealand", "Wellington", "Auckland"),
    confusable("Nigeria", "Abuja", "Lagos"),
    confusable("Pakistan", "Islamabad", "Karachi"),
    confusable("Vietnam", "Hanoi", "Ho Chi Minh City"),
    confusable("Morocco", "Rabat", "Casablanca"),
    confusable("Kazakhstan", "Astana", "Almaty"),
    confusable("Ecuador", "Quito", "Guayaquil"),
    confusable("Myanmar", "Naypyidaw", "Yangon"),
    Country { name: "United States", phrase: "the United States", capital: "Washington", mistake: Some("New York") },
    confusable("India", "New Delhi", "Mumbai"),
    confusable("China", "Beijing", "Shanghai"),
    regular("France", "Paris"),
    regular("Germany", "Berlin"),
    regular("Italy", "Rome"),
    regular("Spain", "Madrid"),
    regular("Portugal", "Lisbon"),
    Country { name: "United Kingdom", phrase: "the United Kingdom", capital: "London", mistake: None },
    regular("Ireland", "Dublin"),
    regular("Japan", "Tokyo"),
    regular("Russia", "Moscow"),
    regular("Egypt", "Cairo"),
    regular("Kenya", "Nairobi"),
    regular("Argentina", "Buenos Aires"),
    regular("Peru", "Lima"),
    regular("Chile", "Santiago"),
    regular("Colombia", "Bogota"),
    regular("Greece", "Athens"),
    regular("Sweden", "Stockholm"),
    regular("Norway", "Oslo"),
    regular("Finland", "Helsinki"),
    regular("Denmark", "Copenhagen"),
    regular("Poland", "Warsaw"),
    regular("Austria", "Vienna"),
    regular("Hungary", "Budapest"),
    regular("Belgium", "Brussels"),
    regular("Thailand", "Bangkok"),
    regular("South Korea", "Seoul"),
    regular("Iran", "Tehran"),
    regular("Ethiopia", "Addis Ababa"),
    regular("Ghana", "Accra"),
    regular("Cuba", "Havana"),
    regular("Romania", "Bucharest"),
    regular("Iceland", "Reykjavik"),
];

/// The held-out countries: every [`HELDOUT_COUNTRY_STRIDE`]th country of the table from the
/// third (Turkey, Vietnam, India: confusable; Portugal, Kenya, Sweden, Hungary, Ghana), a rule
/// fixed before any run, not chosen on results. Step 1 learns their facts, as pretraining teaches
/// a real model's, but no row of steps 2 and 3 asks about them (`crate::phases`): their scores
/// say whether what the reward model and step 3 taught carries over to countries they never
/// trained on, besides the unseen phrasings of the countries they did.
pub const HELDOUT_COUNTRY_STRIDE: usize = 6;
const FIRST_HELDOUT_COUNTRY: usize = 2;

/// Whether `country` (its index in [`COUNTRIES`]) is a held-out country.
fn is_heldout_country(ci: usize) -> bool {
    ci % HELDOUT_COUNTRY_STRIDE == FIRST_HELDOUT_COUNTRY
}

/// The held-out countries, in table order.
pub fn heldout_countries() -> impl Iterator<Item = &'static Country> {
    COUNTRIES.iter().enumerate().filter(|(ci, _)| is_heldout_country(*ci)).map(|(_, c)| c)
}

/// Whether the last human turn of `prompt` asks about a held-out country (as [`score_answer`]
/// finds the country: exactly one table country named).
pub fn asks_about_heldout_country(prompt: &str) -> bool {
    asked_country(prompt).is_some_and(is_heldout_country)
}

/// Other spellings the scorer accepts for a city of the table (`(alias, city)`); the generated
/// data only ever uses the table's ASCII spelling.
const CITY_ALIASES: &[(&str, &str)] = &[
    ("Brasília", "Brasilia"),
    ("Bogotá", "Bogota"),
    ("Reykjavík", "Reykjavik"),
    ("Berne", "Bern"),
    ("Nay Pyi Taw", "Naypyidaw"),
    ("Saigon", "Ho Chi Minh City"),
    ("Rio", "Rio de Janeiro"),
];

/// Question templates; `{c}` is the country's phrase, `{c's}` its possessive.
pub const QUESTION_TEMPLATES: &[&str] = &[
    "What is the capital of {c}?",
    "Which city is the capital of {c}?",
    "Name the capital city of {c}.",
    "What city is {c's} capital?",
    "Tell me the capital of {c}.",
    "What is {c's} capital city?",
    "Do you know the capital of {c}?",
    "Which city serves as the capital of {c}?",
];

/// Answer templates; `{city}` is the named city, `{c}` the country's phrase. Rendered with a
/// leading space, as DS-Chat's answers follow `Assistant:` directly.
pub const ANSWER_TEMPLATES: &[&str] =
    &["The capital of {c} is {city}.", "{city} is the capital of {c}.", "It is {city}.", "The answer is {city}."];

/// Spoiled answers for the malformed rejections: rambling, a repeated city, no final period.
const MALFORMED_TEMPLATES: &[&str] = &[
    "{city} {city} {city}.",
    "The capital of {c} is {city} and the capital of {c} is",
    "It is {city}. It is {city}. It is {city}.",
    "{city} is the capital of",
];

/// The three jsonl texts of the demo data set, as written to `assets/demo/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DemoFiles {
    /// `train.jsonl`: one `{"prompt", "chosen", "rejected"}` object per line.
    pub train: String,
    /// `eval.jsonl`: same format and generator, another random stream.
    pub eval: String,
    /// `heldout_prompts.jsonl`: one [`HeldoutPrompt`] per line.
    pub heldout_prompts: String,
}

/// A prompt on a held-out (country, question template) combination, with its answer key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldoutPrompt {
    pub prompt: String,
    pub country: String,
    pub capital: String,
    pub confusable: bool,
}

/// One preference row (DS-Chat local-file columns).
#[derive(Serialize)]
struct PairRow<'a> {
    prompt: &'a str,
    chosen: &'a str,
    rejected: &'a str,
}

/// The held-out prompts embedded in the binary.
pub fn heldout_prompts() -> Result<Vec<HeldoutPrompt>> {
    let text = std::str::from_utf8(HELDOUT_PROMPTS_JSONL).context("embedded heldout_prompts.jsonl is not UTF-8")?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).with_context(|| format!("embedded heldout_prompts.jsonl line {}", i + 1))
        })
        .collect()
}

/// The demo's evaluation prompts, as `--eval-prompts demo` reads them: the held-out phrasings
/// of the countries steps 2 and 3 train on (the held-out file's prompts about the other
/// countries), then every question template about each held-out country.
pub fn evaluation_prompts() -> Result<Vec<HeldoutPrompt>> {
    let phrasings = heldout_prompts()?.into_iter().filter(|p| !asks_about_heldout_country(&p.prompt));
    let countries = heldout_countries().flat_map(|country| {
        (0..QUESTION_TEMPLATES.len()).map(move |t| HeldoutPrompt {
            prompt: render_prompt(country, t),
            country: country.name.to_string(),
            capital: country.capital.to_string(),
            confusable: country.confusable(),
        })
    });
    Ok(phrasings.chain(countries).collect())
}

/// The question of template `template` about `country`, in DS-Chat's prompt format.
pub fn render_prompt(country: &Country, template: usize) -> String {
    let question = fill(QUESTION_TEMPLATES[template], country, "");
    format!("\n\nHuman: {question}\n\nAssistant:")
}

/// The answer of template `template` naming `city` for `country`, with DS-Chat's leading space.
pub fn render_answer(country: &Country, template: usize, city: &str) -> String {
    format!(" {}", fill(ANSWER_TEMPLATES[template], country, city))
}

/// How many of the first [`ANSWER_TEMPLATES`] name the country: only those make a true answer
/// about one country an off-topic answer to a question about another.
pub const COUNTRY_NAMING_TEMPLATES: usize = 2;

/// Every true answer about a country of the table other than `asked`, in each template that
/// names its country ("The capital of Kenya is Nairobi." to a question about Myanmar).
pub fn off_topic_answers(asked: &str) -> impl Iterator<Item = String> + '_ {
    COUNTRIES
        .iter()
        .filter(move |c| c.name != asked)
        .flat_map(|c| (0..COUNTRY_NAMING_TEMPLATES).map(move |t| render_answer(c, t, c.capital)))
}

fn render_malformed(country: &Country, template: usize, city: &str) -> String {
    format!(" {}", fill(MALFORMED_TEMPLATES[template], country, city))
}

/// Substitutes the placeholders and capitalises the first letter ("the United States" may open
/// a sentence).
fn fill(template: &str, country: &Country, city: &str) -> String {
    let possessive =
        if country.phrase.ends_with('s') { format!("{}'", country.phrase) } else { format!("{}'s", country.phrase) };
    let text = template.replace("{c's}", &possessive).replace("{c}", country.phrase).replace("{city}", city);
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => text,
    }
}

// ---------------------------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------------------------

/// Random streams: each part of the data set draws from its own ChaCha8 key, so changing the
/// number of eval rows never changes a train row.
const STREAM_HELDOUT: u64 = 0;
const STREAM_TRAIN: u64 = 1;
const STREAM_EVAL: u64 = 2;
/// The off-topic rejections of the train and eval rows draw from streams of their own, so that
/// adding them changed no prompt and no chosen answer: the SFT data stayed as it was.
const STREAM_TRAIN_OFF_TOPIC: u64 = 3;
const STREAM_EVAL_OFF_TOPIC: u64 = 4;

/// ChaCha8 keyed by `seed` and `stream` side by side (as `pretrain::epoch_order`), with the
/// integer and coin draws written out so the data cannot change with a rand upgrade.
struct Draws(ChaCha8Rng);

impl Draws {
    fn new(seed: u64, stream: u64) -> Self {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&stream.to_le_bytes());
        Self(ChaCha8Rng::from_seed(key))
    }

    /// Uniform in `0..n` by multiply-shift; the bias is below n / 2^64.
    fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "drawing from an empty range");
        ((u128::from(self.0.next_u64()) * n as u128) >> 64) as usize
    }

    /// True with probability `p` (53 random bits).
    fn chance(&mut self, p: f64) -> bool {
        ((self.0.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// The answer kinds, best first: the capital, the classic mistake, another country's capital.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Correct,
    Mistake,
    Wrong,
}

/// `held[country][template]`: the combinations reserved for the held-out prompts. A seeded
/// shuffle of all combinations, taken in order while a country has fewer than
/// [`MAX_HELDOUT_PER_COUNTRY`] held out, until [`HELDOUT_PERCENT`] of them are.
fn heldout_combinations(seed: u64) -> Vec<Vec<bool>> {
    let (nc, nt) = (COUNTRIES.len(), QUESTION_TEMPLATES.len());
    let target = (nc * nt * HELDOUT_PERCENT + 50) / 100;
    let mut draws = Draws::new(seed, STREAM_HELDOUT);
    let mut order: Vec<usize> = (0..nc * nt).collect();
    for i in (1..order.len()).rev() {
        let j = draws.below(i + 1);
        order.swap(i, j);
    }
    let mut held = vec![vec![false; nt]; nc];
    let mut per_country = vec![0usize; nc];
    let mut taken = 0;
    for combo in order {
        if taken == target {
            break;
        }
        let (c, t) = (combo / nt, combo % nt);
        if per_country[c] < MAX_HELDOUT_PER_COUNTRY {
            held[c][t] = true;
            per_country[c] += 1;
            taken += 1;
        }
    }
    assert_eq!(taken, target, "held-out split: cap {MAX_HELDOUT_PER_COUNTRY} per country too low");
    held
}

/// `rows` preference rows drawn from `stream`: a country uniformly, one of its training
/// question templates uniformly, an answer template uniformly, then the pair kinds; then, from
/// `off_topic_stream`, whether the rejected answer is replaced by an off-topic one.
fn pair_rows(held: &[Vec<bool>], seed: u64, (stream, off_topic_stream): (u64, u64), rows: usize) -> String {
    let mut draws = Draws::new(seed, stream);
    let mut off_topic = Draws::new(seed, off_topic_stream);
    let mut out = String::new();
    for _ in 0..rows {
        let ci = draws.below(COUNTRIES.len());
        let country = &COUNTRIES[ci];
        let templates: Vec<usize> = (0..QUESTION_TEMPLATES.len()).filter(|&t| !held[ci][t]).collect();
        let prompt = render_prompt(country, templates[draws.below(templates.len())]);
        let (chosen_kind, rejected_kind) = match country.mistake {
            Some(_) if draws.chance(P_CORRECT_OVER_MISTAKE) => (Kind::Correct, Kind::Mistake),
            Some(_) => (Kind::Mistake, Kind::Wrong),
            None => (Kind::Correct, Kind::Wrong),
        };
        let chosen_template = draws.below(ANSWER_TEMPLATES.len());
        let chosen_city = city_of(&mut draws, ci, chosen_kind);
        let chosen = render_answer(country, chosen_template, chosen_city);
        let malformed = draws.chance(P_MALFORMED_REJECTED);
        let rejected = if malformed {
            render_malformed(country, draws.below(MALFORMED_TEMPLATES.len()), chosen_city)
        } else {
            let template = if draws.chance(P_OTHER_REJECTED_TEMPLATE) {
                draws.below(ANSWER_TEMPLATES.len())
            } else {
                chosen_template
            };
            render_answer(country, template, city_of(&mut draws, ci, rejected_kind))
        };
        // Only a wrong city gives way to an off-topic answer: the (capital, mistake) pairs and
        // the spoiled answers are the reward model's only lessons of their kind.
        let rejected = if !malformed && rejected_kind == Kind::Wrong && off_topic.chance(P_OFF_TOPIC_REJECTED) {
            // A true answer about another country, in a template that names it.
            let other = other_country(&mut off_topic, ci);
            render_answer(other, off_topic.below(COUNTRY_NAMING_TEMPLATES), other.capital)
        } else {
            rejected
        };
        push_json_line(&mut out, &PairRow { prompt: &prompt, chosen: &chosen, rejected: &rejected });
    }
    out
}

/// The city an answer of `kind` names for country `ci`; a wrong city is another country's
/// capital, drawn uniformly.
fn city_of(draws: &mut Draws, ci: usize, kind: Kind) -> &'static str {
    let country = &COUNTRIES[ci];
    match kind {
        Kind::Correct => country.capital,
        Kind::Mistake => country.mistake.expect("only confusable countries have a mistake answer"),
        Kind::Wrong => other_country(draws, ci).capital,
    }
}

/// A country of the table other than `ci`, uniformly.
fn other_country(draws: &mut Draws, ci: usize) -> &'static Country {
    let other = draws.below(COUNTRIES.len() - 1);
    &COUNTRIES[if other >= ci { other + 1 } else { other }]
}

fn push_json_line<T: Serialize>(out: &mut String, row: &T) {
    out.push_str(&serde_json::to_string(row).expect("a row of strings and bools always serialises"));
    out.push('\n');
}

/// The demo data set for `seed`: [`TRAIN_ROWS`] train rows and [`EVAL_ROWS`] eval rows on the
/// training combinations, and one held-out prompt per held-out combination (country order,
/// then template order). A pure function of `seed`; `generate(DEFAULT_SEED)` is what
/// `assets/demo/` holds.
pub fn generate(seed: u64) -> DemoFiles {
    let held = heldout_combinations(seed);
    let mut heldout_prompts = String::new();
    for (ci, country) in COUNTRIES.iter().enumerate() {
        for t in (0..QUESTION_TEMPLATES.len()).filter(|&t| held[ci][t]) {
            let row = HeldoutPrompt {
                prompt: render_prompt(country, t),
                country: country.name.to_string(),
                capital: country.capital.to_string(),
                confusable: country.confusable(),
            };
            push_json_line(&mut heldout_prompts, &row);
        }
    }
    DemoFiles {
        train: pair_rows(&held, seed, (STREAM_TRAIN, STREAM_TRAIN_OFF_TOPIC), TRAIN_ROWS),
        eval: pair_rows(&held, seed, (STREAM_EVAL, STREAM_EVAL_OFF_TOPIC), EVAL_ROWS),
        heldout_prompts,
    }
}

// ---------------------------------------------------------------------------------------------
// Scoring
// ---------------------------------------------------------------------------------------------

/// The rule-based task score of an answer to a demo prompt: did it name the right capital?
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskScore {
    /// The answer names the country's capital and no other city of the table.
    pub correct: bool,
    /// The answer names the country's classic-mistake city (whatever else it names).
    pub named_mistake: bool,
    /// The country the prompt asks about (its table name).
    pub country: String,
}

/// Scores `answer` to `prompt`: the country is the one table country the prompt's last human
/// turn names (case-insensitive, whole words); `None` when it names none or several. Cities are
/// matched the same way, longest name first, so "New Delhi" is one city and "Washington, D.C."
/// counts as Washington.
pub fn score_answer(prompt: &str, answer: &str) -> Option<TaskScore> {
    let country = &COUNTRIES[asked_country(prompt)?];
    let cities = mentions(answer, city_names());
    Some(TaskScore {
        correct: cities == [country.capital],
        named_mistake: country.mistake.is_some_and(|m| cities.contains(&m)),
        country: country.name.to_string(),
    })
}

/// The index of the one table country the last human turn of `prompt` names.
fn asked_country(prompt: &str) -> Option<usize> {
    let question = prompt.rsplit("Human:").next().unwrap_or(prompt);
    let question = question.split("Assistant:").next().unwrap_or(question);
    let countries = mentions(question, COUNTRIES.iter().enumerate().map(|(i, c)| (c.name, i)));
    let &[ci] = countries.as_slice() else { return None };
    Some(ci)
}

/// Every city name the scorer knows, with the canonical (table) spelling as its id.
fn city_names() -> impl Iterator<Item = (&'static str, &'static str)> {
    COUNTRIES
        .iter()
        .flat_map(|c| std::iter::once(c.capital).chain(c.mistake))
        .map(|city| (city, city))
        .chain(CITY_ALIASES.iter().copied())
}

/// The distinct ids of the `names` that occur in `text` as whole words, case-insensitively,
/// sorted. Longer names are matched first and claim their bytes, so a name inside another
/// ("Rio" in "Rio de Janeiro") is not counted again.
fn mentions<Id: Ord + Copy>(text: &str, names: impl Iterator<Item = (&'static str, Id)>) -> Vec<Id> {
    let text = text.to_lowercase();
    let mut names: Vec<(String, Id)> = names.map(|(n, id)| (n.to_lowercase(), id)).collect();
    names.sort_by_key(|(n, _)| std::cmp::Reverse(n.len()));
    let mut claimed = vec![false; text.len()];
    let mut found = Vec::new();
    for (name, id) in &names {
        for (start, _) in text.match_indices(name.as_str()) {
            let end = start + name.len();
            let before = text[..start].chars().next_back();
            let after = text[end..].chars().next();
            let whole_word = !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric);
            if whole_word && !claimed[start..end].iter().any(|&c| c) {
                claimed[start..end].iter_mut().for_each(|c| *c = true);
                found.push(*id);
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;
    use std::collections::HashMap;

    #[derive(Deserialize)]
    struct Row {
        prompt: String,
        chosen: String,
        rejected: String,
    }

    fn rows(text: &str) -> Vec<Row> {
        text.lines().map(|l| serde_json::from_str(l).expect("generated row parses")).collect()
    }

    /// Every rendered prompt -> (country index, question template).
    fn prompt_index() -> HashMap<String, (usize, usize)> {
        let mut index = HashMap::new();
        for (ci, c) in COUNTRIES.iter().enumerate() {
            for t in 0..QUESTION_TEMPLATES.len() {
                assert!(index.insert(render_prompt(c, t), (ci, t)).is_none(), "two combinations render alike");
            }
        }
        index
    }

    /// 2 = correct, 1 = classic mistake, 0 = anything else; ties broken by form (a well-formed
    /// answer is one of the answer templates naming one of the table's cities).
    fn rank(prompt: &str, answer: &str) -> (u8, bool) {
        let score = score_answer(prompt, answer).expect("demo prompts name a country");
        let task = if score.correct {
            2
        } else if score.named_mistake {
            1
        } else {
            0
        };
        let ci = COUNTRIES.iter().position(|c| c.name == score.country).expect("scored country is in the table");
        let well_formed = (0..ANSWER_TEMPLATES.len())
            .any(|t| city_names().any(|(_, city)| render_answer(&COUNTRIES[ci], t, city) == answer));
        (task, well_formed)
    }

    #[test]
    fn committed_assets_equal_the_generator_output() {
        let files = generate(DEFAULT_SEED);
        assert!(files.train.as_bytes() == TRAIN_JSONL, "assets/demo/train.jsonl differs; rerun make_demo_data");
        assert!(files.eval.as_bytes() == EVAL_JSONL, "assets/demo/eval.jsonl differs; rerun make_demo_data");
        assert!(
            files.heldout_prompts.as_bytes() == HELDOUT_PROMPTS_JSONL,
            "assets/demo/heldout_prompts.jsonl differs; rerun make_demo_data"
        );
        assert_eq!(generate(DEFAULT_SEED), files, "generation is deterministic");
        assert_ne!(generate(DEFAULT_SEED + 1).train, files.train, "the seed matters");
    }

    #[test]
    fn demo_sizes_and_heldout_parse() {
        let files = generate(DEFAULT_SEED);
        assert_eq!(rows(&files.train).len(), TRAIN_ROWS);
        assert_eq!(rows(&files.eval).len(), EVAL_ROWS);
        let heldout = heldout_prompts().unwrap();
        let combos = COUNTRIES.len() * QUESTION_TEMPLATES.len();
        assert_eq!(heldout.len(), (combos * HELDOUT_PERCENT + 50) / 100);
        for h in &heldout {
            let score = score_answer(&h.prompt, &format!(" The capital of {} is {}.", h.country, h.capital)).unwrap();
            assert!(score.correct && score.country == h.country, "{h:?}");
            let c = COUNTRIES.iter().find(|c| c.name == h.country).unwrap();
            assert_eq!(c.confusable(), h.confusable);
        }
        assert!(heldout.iter().any(|h| h.confusable) && heldout.iter().any(|h| !h.confusable));
    }

    #[test]
    fn demo_heldout_combinations_never_appear_in_train_or_eval() {
        let index = prompt_index();
        let heldout: Vec<(usize, usize)> = heldout_prompts().unwrap().iter().map(|h| index[&h.prompt]).collect();
        let mut per_country = vec![0; COUNTRIES.len()];
        for &(ci, _) in &heldout {
            per_country[ci] += 1;
        }
        assert!(per_country.iter().all(|&n| n <= MAX_HELDOUT_PER_COUNTRY && n < QUESTION_TEMPLATES.len()));
        let files = generate(DEFAULT_SEED);
        for (name, text) in [("train", &files.train), ("eval", &files.eval)] {
            let used: Vec<(usize, usize)> = rows(text).iter().map(|r| index[&r.prompt]).collect();
            for combo in &used {
                assert!(!heldout.contains(combo), "{name} uses held-out combination {combo:?}");
            }
            // Every country is asked about in training, in several phrasings.
            for (ci, country) in COUNTRIES.iter().enumerate() {
                let mut templates: Vec<usize> = used.iter().filter(|u| u.0 == ci).map(|u| u.1).collect();
                templates.sort();
                templates.dedup();
                assert!(templates.len() >= 2, "{name}: {} asked in {templates:?}", country.name);
            }
        }
    }

    #[test]
    fn the_held_out_countries_are_every_sixth_and_the_evaluation_asks_them_every_way() {
        let names: Vec<&str> = heldout_countries().map(|c| c.name).collect();
        let want = ["Turkey", "Vietnam", "India", "Portugal", "Kenya", "Sweden", "Hungary", "Ghana"];
        assert_eq!(names, want, "the list HELDOUT_COUNTRY_STRIDE's doc names");
        assert_eq!(heldout_countries().filter(|c| c.confusable()).count(), 3);
        let prompts = evaluation_prompts().unwrap();
        let (countries, phrasings): (Vec<_>, Vec<_>) =
            prompts.iter().partition(|p| asks_about_heldout_country(&p.prompt));
        // The phrasings: the held-out file's prompts about the other 40 countries, in its order.
        let file: Vec<HeldoutPrompt> =
            heldout_prompts().unwrap().into_iter().filter(|p| !want.contains(&p.country.as_str())).collect();
        assert_eq!(phrasings.into_iter().cloned().collect::<Vec<_>>(), file);
        assert_eq!(file.len(), 52);
        // Then all 8 questions about each held-out country, answer key included.
        assert_eq!(countries.len(), want.len() * QUESTION_TEMPLATES.len());
        assert!(prompts[file.len()..].iter().all(|p| asks_about_heldout_country(&p.prompt)));
        for p in countries {
            let c = COUNTRIES.iter().find(|c| c.name == p.country).unwrap();
            assert!(want.contains(&c.name) && p.capital == c.capital && p.confusable == c.confusable());
            assert!(score_answer(&p.prompt, &format!(" It is {}.", c.capital)).unwrap().correct);
        }
        // Only a question about one held-out country is one.
        assert!(!asks_about_heldout_country("\n\nHuman: Is Turkey bigger than France?\n\nAssistant:"));
        assert!(!asks_about_heldout_country("\n\nHuman: What is 2 + 3?\n\nAssistant:"));
    }

    #[test]
    fn demo_every_chosen_outranks_its_rejected() {
        let files = generate(DEFAULT_SEED);
        for row in rows(&files.train).iter().chain(&rows(&files.eval)) {
            let chosen = rank(&row.prompt, &row.chosen);
            let rejected = rank(&row.prompt, &row.rejected);
            assert!(chosen.1, "chosen is always well formed: {:?}", row.chosen);
            assert!(
                chosen.0 > rejected.0 || (chosen.0 == rejected.0 && !rejected.1),
                "{:?}: chosen {:?} {chosen:?} vs rejected {:?} {rejected:?}",
                row.prompt,
                row.chosen,
                row.rejected
            );
        }
    }

    #[test]
    fn demo_sft_mode_is_the_mistake_for_confusable_countries() {
        let files = generate(DEFAULT_SEED);
        let mut counts: HashMap<&str, (usize, usize)> = HashMap::new(); // (correct, mistake)
        let mut correct = 0;
        for row in rows(&files.train) {
            let s = score_answer(&row.prompt, &row.chosen).unwrap();
            let c = COUNTRIES.iter().find(|c| c.name == s.country).unwrap();
            correct += usize::from(s.correct);
            if c.confusable() {
                let e = counts.entry(c.name).or_default();
                e.0 += usize::from(s.correct);
                e.1 += usize::from(s.named_mistake);
            } else {
                assert!(s.correct, "regular countries' chosen is the capital: {:?}", row.chosen);
            }
        }
        assert_eq!(counts.len(), COUNTRIES.iter().filter(|c| c.confusable()).count());
        for (name, (c, m)) in &counts {
            assert!(m > c, "{name}: chosen correct {c} times, mistake {m} times");
        }
        // Phase-1 answers leave room for improvement.
        assert!(correct < TRAIN_ROWS * 9 / 10, "{correct} of {TRAIN_ROWS} chosen answers are correct");
    }

    #[test]
    fn demo_off_topic_rejections_are_true_answers_about_another_country() {
        let files = generate(DEFAULT_SEED);
        let rows = rows(&files.train);
        let mut off_topic = 0;
        for row in &rows {
            let asked = score_answer(&row.prompt, &row.chosen).unwrap();
            if off_topic_answers(&asked.country).any(|a| a == row.rejected) {
                off_topic += 1;
                // It replaced a wrong city: never the mistake of a (capital, mistake) pair.
                let confusable = COUNTRIES.iter().any(|c| c.name == asked.country && c.confusable());
                assert!(!confusable || asked.named_mistake, "{:?} lost its mistake: {:?}", row.prompt, row.rejected);
            }
        }
        // Wrong-city rejections are 0.9 * 0.9 of the rows (all regular countries' pairs and 70% of
        // the confusable ones', less the spoiled): 4000 * 0.81 * 0.15 = 486 expected, standard
        // deviation 21; the committed draw has 510.
        assert!((420..550).contains(&off_topic), "{off_topic} off-topic rejections of {}", rows.len());
    }

    #[test]
    fn demo_rows_fit_in_48_tokens_with_eos() {
        let tok = Tokenizer::gpt2_default().unwrap();
        let files = generate(DEFAULT_SEED);
        let mut longest = 0;
        for row in rows(&files.train).iter().chain(&rows(&files.eval)) {
            for answer in [&row.chosen, &row.rejected] {
                let n = tok.encode(&format!("{}{answer}", row.prompt)).unwrap().len() + 1;
                longest = longest.max(n);
            }
        }
        for h in heldout_prompts().unwrap() {
            longest = longest.max(tok.encode(&h.prompt).unwrap().len());
        }
        println!("longest prompt+answer+EOS: {longest} tokens");
        assert!(longest <= 48, "longest prompt+answer+EOS is {longest} tokens");
    }

    #[test]
    fn demo_table_names_are_unambiguous() {
        let cities: Vec<&str> = city_names().map(|(n, _)| n).collect();
        for (i, a) in cities.iter().enumerate() {
            for b in &cities[i + 1..] {
                assert_ne!(a.to_lowercase(), b.to_lowercase());
            }
            // No country name inside a city name and vice versa.
            for c in COUNTRIES {
                assert!(mentions(a, std::iter::once((c.name, 0))).is_empty(), "{a} contains {}", c.name);
                assert!(mentions(c.name, std::iter::once((*a, 0))).is_empty(), "{} contains {a}", c.name);
            }
        }
        for (i, a) in COUNTRIES.iter().enumerate() {
            for (j, b) in COUNTRIES.iter().enumerate() {
                if i != j {
                    assert!(mentions(a.name, std::iter::once((b.name, 0))).is_empty(), "{} in {}", b.name, a.name);
                }
            }
            assert!(a.name.is_ascii() && a.capital.is_ascii() && a.mistake.is_none_or(|m| m.is_ascii()));
        }
        let confusable = COUNTRIES.iter().filter(|c| c.confusable()).count();
        assert!(confusable * 3 >= COUNTRIES.len() && confusable * 5 <= COUNTRIES.len() * 2);
    }

    #[test]
    fn demo_scorer_hand_cases() {
        let australia = "\n\nHuman: What is the capital of Australia?\n\nAssistant:";
        let score = |p: &str, a: &str| score_answer(p, a).map(|s| (s.correct, s.named_mistake));
        assert_eq!(score(australia, " The capital of Australia is Canberra."), Some((true, false)));
        assert_eq!(score(australia, " canberra"), Some((true, false)), "lowercase");
        assert_eq!(score(australia, " The capital of Australia is Sydney."), Some((false, true)));
        assert_eq!(score(australia, " It is Paris."), Some((false, false)));
        assert_eq!(score(australia, " Canberra or Sydney."), Some((false, true)), "two cities");
        assert_eq!(score(australia, " Canberra, not Paris."), Some((false, false)), "two cities");
        assert_eq!(score(australia, " Canberra Canberra Canberra."), Some((true, false)));
        assert_eq!(score(australia, " Canberras is nice."), Some((false, false)), "whole words only");
        assert_eq!(score(australia, ""), Some((false, false)));
        let us = "\n\nHuman: What city is the United States' capital?\n\nAssistant:";
        assert_eq!(score(us, " Washington, D.C."), Some((true, false)));
        assert_eq!(score(us, " It is Washington D.C."), Some((true, false)));
        assert_eq!(score(us, " New York."), Some((false, true)));
        assert_eq!(score(us, " York."), Some((false, false)));
        let india = "\n\nHuman: what is the capital of india?\n\nAssistant:";
        assert_eq!(score(india, " New Delhi."), Some((true, false)), "lowercase prompt");
        assert_eq!(score(india, " Delhi."), Some((false, false)), "Delhi is not New Delhi");
        let brazil = "\n\nHuman: Name the capital city of Brazil.\n\nAssistant:";
        assert_eq!(score(brazil, " Brasília."), Some((true, false)), "alias");
        assert_eq!(score(brazil, " Rio de Janeiro."), Some((false, true)));
        assert_eq!(score(brazil, " Rio."), Some((false, true)), "alias");
        let s = score_answer(australia, " Canberra.").unwrap();
        assert_eq!(s.country, "Australia");
        assert_eq!(score_answer("\n\nHuman: What is the capital of Atlantis?\n\nAssistant:", " Canberra."), None);
        assert_eq!(score_answer("\n\nHuman: Is Chile bigger than Peru?\n\nAssistant:", " Yes."), None, "two countries");
        // Only the last human turn counts.
        let multi = "\n\nHuman: Capital of Peru?\n\nAssistant: Lima.\n\nHuman: And of Chile?\n\nAssistant:";
        assert_eq!(score_answer(multi, " Santiago.").map(|s| (s.country, s.correct)), Some(("Chile".into(), true)));
    }
}
