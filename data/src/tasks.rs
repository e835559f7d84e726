//! The embedded tasks' rule scorers, whichever task a prompt belongs to: the demo's capitals
//! ([`crate::demo::score_answer`]) and arithmetic ([`crate::arithmetic::score_answer`]). What
//! the held-out evaluations call the task score.

/// Whether `answer` is right, `None` when `prompt` belongs to no embedded task.
pub fn score_answer(prompt: &str, answer: &str) -> Option<bool> {
    crate::demo::score_answer(prompt, answer)
        .map(|s| s.correct)
        .or_else(|| crate::arithmetic::score_answer(prompt, answer))
}

/// The share of `(prompt, answer)` pairs answered right (a prompt of no task counts as wrong);
/// `None` when no prompt belongs to a task.
pub fn task_score(pairs: &[(String, String)]) -> Option<f64> {
    let scores: Vec<Option<bool>> = pairs.iter().map(|(p, a)| score_answer(p, a)).collect();
    if scores.iter().all(Option::is_none) {
        return None;
    }
    Some(scores.iter().filter(|s| **s == Some(true)).count() as f64 / pairs.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_prompt_is_scored_by_its_task() {
        let capital = "\n\nHuman: What is the capital of France?\n\nAssistant:".to_string();
        let sum = "\n\nHuman: What is 27 + 15?\n\nAssistant:".to_string();
        let other = "\n\nHuman: Tell me a joke.\n\nAssistant:".to_string();
        assert_eq!(score_answer(&capital, " Paris."), Some(true));
        assert_eq!(score_answer(&sum, " 42."), Some(true));
        assert_eq!(score_answer(&sum, " Paris."), Some(false));
        assert_eq!(score_answer(&other, " 42."), None);
        let pairs = |v: &[(&String, &str)]| v.iter().map(|(p, a)| (p.to_string(), a.to_string())).collect::<Vec<_>>();
        assert_eq!(task_score(&pairs(&[(&capital, " Paris."), (&sum, " 32."), (&other, " hi")])), Some(1.0 / 3.0));
        assert_eq!(task_score(&pairs(&[(&other, " hi")])), None);
        assert_eq!(task_score(&[]), None, "no pairs: no task to score");
    }

    #[test]
    fn the_demo_task_score_is_the_mean_of_correct() {
        let p = |c: &str| format!("\n\nHuman: What is the capital of {c}?\n\nAssistant:");
        let pairs = vec![
            (p("Canada"), " Ottawa.".to_string()),
            (p("Canada"), " Toronto.".to_string()),
            (p("France"), " It is Paris.".to_string()),
            (p("Atlantis"), " Paris.".to_string()),
        ];
        assert_eq!(task_score(&pairs), Some(0.5), "a prompt about no known country counts as wrong");
    }
}
