"""WebShop (Yao et al. 2022): buy the product an instruction asks for, in a text-mode web shop.

Two back-ends behind one adapter:
- the real WebShop, when its package (`web_agent_site`, github.com/princeton-nlp/WebShop) and its product
  data are installed: its text environment (`WebAgentTextEnv`, observation_mode="text", human goals), with
  ETO's goal indices (data/eto/): train 1824 goals, seen = ETO's test 200, no unseen split;
- otherwise the project's mini shop (envs/webshop_data/, built by envs/webshop_build.py): 360 products,
  BM25 search (rank_bm25), WebShop's pages, buttons and reward (envs/webshop_reward.py); train 900,
  seen 200 and unseen 200 goals, unseen goals being for products no train goal targets.

Pages are WebShop's text observations, visible strings joined by " [SEP] ": the search page
("WebShop [SEP] Instruction: [SEP] ... [SEP] Search"), result pages of 10 (Back to Search, Page i (Total
results: n), < Prev, Next >, then ASIN, title, price per product), item pages (option groups and values,
title, price, rating, Description / Features / Reviews / Attributes, Buy Now) and their sub-pages.
Actions are `search[keywords]` (search page only) and `click[value]` with a value shown on the page
(case-insensitive). An action the page does not allow returns "Invalid action!" followed by the unchanged
page (ETO's text; the stock WebShop silently shows the page again), reward 0, not done.
Rewards: 0 until `click[Buy Now]`, then the purchase score in [0, 1]; episodes end on buying or after
max_steps steps (paper: 10).
"""
from __future__ import annotations

import json
import re
import warnings
from functools import lru_cache
from pathlib import Path

from rank_bm25 import BM25Okapi

from envs import EnvError, Task, TextEnv, canonical_split
from envs.webshop_reward import purchase_reward

DATA_DIR = Path(__file__).resolve().parent / "webshop_data"
ETO_DIR = Path(__file__).resolve().parent.parent / "data" / "eto"
ETO_FILES = {"train": "data_webshop_train_indices.json", "seen": "data_webshop_test_indices.json"}
SEP, PAGE_SIZE, MAX_RESULTS = " [SEP] ", 10, 50
SUBPAGES = ("Description", "Features", "Reviews", "Attributes")
INVALID = "Invalid action!"
ACTION = re.compile(r"(search|click)\[(.+)\]", re.IGNORECASE | re.DOTALL)
LEAD = re.compile(r"^(i need|i want|i am looking for|i'm looking for|find me|i would like)\s+(an? |some )?")
ASIN = re.compile(r"b0[0-9a-z]{8}", re.IGNORECASE)

SYSTEM_PROMPT = """You are shopping in a web store for a customer. Each observation is the current web page:
its visible texts separated by [SEP], beginning with the customer's instruction.
You can act in two ways:
search[keywords] - type keywords into the search bar (only on a page that shows Search);
click[value] - click a button, a product ID or an option value shown on the current page, written as shown.
Open a product by clicking its ID, click the options (size, color, ...) the instruction asks for, and buy it
with click[Buy Now]. An action the page does not allow does nothing: you get "Invalid action!" and the same page.
Answer every turn in exactly this format:
Thought: your short reasoning.
Action: one action."""


def parse_action(action: str) -> tuple[str, str] | None:
    """'click[Buy Now]' -> ('click', 'Buy Now'); None when it is neither search[...] nor click[...]."""
    m = ACTION.fullmatch(action.strip())
    return (m.group(1).lower(), m.group(2).strip()) if m and m.group(2).strip() else None


def tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def expert_keywords(instruction: str) -> str:
    """The instruction without its opening words and price clause, as WebShop's human demonstrators search."""
    return LEAD.sub("", instruction.split(", and price lower than")[0]).strip()


class Catalogue:
    """Products, goals and the BM25 index of one data folder (built once per process, see `catalogue`)."""

    def __init__(self, data_dir: Path):
        try:
            products = json.loads((data_dir / "products.json").read_text(encoding="utf-8"))
            self.goals = json.loads((data_dir / "goals.json").read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise EnvError(f"WebShop data missing: {e.filename}; run python envs/webshop_build.py") from e
        self.products = {p["asin"]: p for p in products}
        self.asins = [p["asin"] for p in products]
        # indexed like WebShop's search engine: title, features, description and option values
        docs = [tokens(" ".join([p["Title"], *p["BulletPoints"], p["Description"], *sum(p["options"].values(), [])]))
                for p in products]
        self.bm25, self._cache = BM25Okapi(docs), {}

    def search(self, keywords: str) -> list[str]:
        """ASINs of the (at most 50) products sharing a word with the keywords, best BM25 score first."""
        key = tuple(tokens(keywords))
        if key not in self._cache:
            scores = self.bm25.get_scores(list(key)) if key else [0.0] * len(self.asins)
            ranked = sorted(range(len(self.asins)), key=lambda i: (-scores[i], i))
            if len(self._cache) > 20000:
                self._cache.clear()
            self._cache[key] = [self.asins[i] for i in ranked if scores[i] > 0][:MAX_RESULTS]
        return self._cache[key]


@lru_cache(maxsize=None)
def catalogue(data_dir: str) -> Catalogue:
    return Catalogue(Path(data_dir))


def real_webshop():
    """WebShop's own text environment, or None when web_agent_site is not installed or cannot start."""
    try:
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
    except ImportError:
        return None
    try:
        return WebAgentTextEnv(observation_mode="text", human_goals=True)
    except Exception as e:  # installed without its product files or search index
        warnings.warn(f"web_agent_site is installed but did not start ({e!r}); using the mini shop instead")
        return None


class WebShopEnv(TextEnv):
    name = "webshop"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, max_steps: int = 10, data_dir: str | None = None):
        """max_steps: step cap per episode (paper: 10). data_dir: a mini-shop data folder; None = the real
        WebShop when it is installed, else the bundled mini shop (envs/webshop_data)."""
        self.max_steps = max_steps
        self.real = real_webshop() if data_dir is None else None
        self.shop = None if self.real else catalogue(str(Path(data_dir or DATA_DIR).resolve()))
        self.goal = None

    # ------------------------------------------------------------------ episodes
    def tasks(self, split: str) -> list[Task]:
        split = canonical_split(split)
        if self.real:  # WebShop's human goals by ETO's indices; WebShop has no unseen split
            if split not in ETO_FILES:
                return []
            indices = json.loads((ETO_DIR / ETO_FILES[split]).read_text())
            return [Task("webshop", "human", i, split, str(i)) for i in indices]
        return [Task("webshop", g["category"], i, split, g["id"]) for i, g in enumerate(self.shop.goals)
                if g["split"] == split]

    def reset(self, task: Task) -> tuple[str, dict]:
        if task.env != "webshop":
            raise EnvError(f"task {task.key} is not a WebShop task")
        self.t, self.score, self.done = 0, 0.0, False
        if self.real:
            obs, _ = self.real.reset(session=task.variation)
            self.goal = {"id": task.source, "instruction_text": self.real.instruction_text}
            return obs, {"instruction": self.real.instruction_text, "goal_id": task.source}
        if not 0 <= task.variation < len(self.shop.goals) or self.shop.goals[task.variation]["id"] != task.source:
            raise EnvError(f"no WebShop goal {task.source!r} at index {task.variation}; rebuild the task list")
        self.goal = self.shop.goals[task.variation]
        self.page, self.results, self.page_no, self.asin, self.sub, self.chosen = "search", [], 0, None, None, {}
        return self.render(), {"instruction": self.goal["instruction_text"], "goal_id": self.goal["id"],
                               "category": self.goal["category"]}

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.goal is None or self.done:
            raise EnvError("the episode is over (or never began): call reset(task) first")
        self.t += 1
        obs, reward, bought, valid = self.act_real(action) if self.real else self.act(action)
        self.score = reward if bought else self.score
        self.done = bought or self.t >= self.max_steps
        return obs, reward, self.done, {"score": self.score, "won": self.score == 1.0, "valid": valid,
                                        "terminated": bought}

    def act_real(self, action: str) -> tuple[str, float, bool, bool]:
        available = self.real.get_available_actions()
        parsed = parse_action(action)
        if parsed is None or not (parsed[0] == "search" and available["has_search_bar"] or parsed[0] == "click" and
                                  parsed[1].lower() in {c.lower() for c in available["clickables"]}):
            return f"{INVALID}\n{self.real.observation}", 0.0, False, False
        kind, arg = parsed
        obs, reward, done, _ = self.real.step(f"{kind}[{arg.lower() if kind == 'click' else arg}]")
        return obs, float(reward), bool(done), True

    # ------------------------------------------------------------------ the mini shop
    def view(self) -> tuple[list[str], list[str]]:
        """The current page's visible strings and its clickable values."""
        head = ["Instruction:", self.goal["instruction_text"]]
        if self.page == "search":
            return ["WebShop", *head, "Search"], []
        if self.page == "results":
            shown = self.results[self.page_no * PAGE_SIZE:(self.page_no + 1) * PAGE_SIZE]
            arrows = (["< Prev"] if self.page_no else []) + \
                (["Next >"] if (self.page_no + 1) * PAGE_SIZE < len(self.results) else [])
            products = [self.shop.products[a] for a in shown]
            rows = [s for p in products for s in (p["asin"], p["Title"], f"${p['price']:.2f}")]
            page = f"Page {self.page_no + 1} (Total results: {len(self.results)})"
            return [*head, "Back to Search", page, *arrows, *rows], ["Back to Search", *arrows, *shown]
        p = self.shop.products[self.asin]
        if self.page == "item":
            values = [v for vs in p["options"].values() for v in vs]
            groups = [s for g, vs in p["options"].items() for s in (g, *vs)]
            texts = [*head, "Back to Search", "< Prev", *groups, p["Title"], f"Price: ${p['price']:.2f}",
                     f"Rating: {p['Rating']}", *SUBPAGES, "Buy Now"]
            return texts, ["Back to Search", "< Prev", *values, *SUBPAGES, "Buy Now"]
        content = {"Description": [p["Description"]], "Features": p["BulletPoints"], "Attributes": p["Attributes"],
                   "Reviews": [s for r in p["Reviews"] for s in (r["title"], str(r["score"]), r["body"])]}[self.sub]
        return [*head, "Back to Search", "< Prev", *content], ["Back to Search", "< Prev"]

    def render(self) -> str:
        return SEP.join(self.view()[0])

    def act(self, action: str) -> tuple[str, float, bool, bool]:
        parsed, clickables = parse_action(action), self.view()[1]
        label = {c.lower(): c for c in clickables}.get(parsed[1].lower()) if parsed and parsed[0] == "click" else None
        if parsed and parsed[0] == "search" and self.page == "search":
            self.results, self.page, self.page_no = self.shop.search(parsed[1]), "results", 0
        elif label is None:
            return f"{INVALID}\n{self.render()}", 0.0, False, False
        elif label == "Buy Now":
            p = self.shop.products[self.asin]
            score = purchase_reward(p, self.goal, self.chosen)
            chosen = [f"{g}: {v}" for g, v in self.chosen.items()]
            page = ["Thank you for shopping with us!", "Purchased", p["asin"], p["Title"], f"${p['price']:.2f}",
                    *chosen, "Your score (min 0.0, max 1.0)", f"{score:.2f}"]
            return SEP.join(page), score, True, True
        else:
            self.click(label)
        return self.render(), 0.0, False, True

    def click(self, label: str) -> None:
        if label == "Back to Search":
            self.page = "search"
        elif label == "Next >":
            self.page_no += 1
        elif label == "< Prev":
            if self.page == "results":
                self.page_no -= 1
            else:
                self.page = {"item": "results", "sub": "item"}[self.page]
        elif label in SUBPAGES:
            self.page, self.sub = "sub", label
        elif self.page == "results":  # a product link
            self.page, self.asin, self.chosen = "item", label, {}
        else:  # an option value: it replaces the choice in its group
            group = next(g for g, vs in self.shop.products[self.asin]["options"].items() if label in vs)
            self.chosen[group] = label

    # ------------------------------------------------------------------ the scripted expert
    def expert_action(self) -> str | None:
        """The shortest path to the goal product from the current page: search -> (Next >) -> product ->
        each goal option -> Buy Now. None with the real WebShop (it ships human demonstrations instead)."""
        if self.real or self.goal is None or self.done:
            return None
        target, keywords = self.goal["asin"], expert_keywords(self.goal["instruction_text"])
        if self.page == "search":
            return f"search[{keywords}]"
        if self.page == "sub":
            return "click[< Prev]"
        if self.page == "results":
            if target in self.results:
                where = self.results.index(target) // PAGE_SIZE
                return f"click[{target}]" if where == self.page_no else \
                    "click[Next >]" if where > self.page_no else "click[< Prev]"
            if self.results == self.shop.search(keywords):  # our own search missed it: take the best match
                return f"click[{self.results[self.page_no * PAGE_SIZE]}]" if self.results else None
            return "click[Back to Search]"
        if self.asin != target and target in self.results:
            return "click[< Prev]"
        options = self.shop.products[self.asin]["options"]
        for group, value in self.goal["goal_options"].items():
            if value in options.get(group, []) and self.chosen.get(group) != value:
                return f"click[{value}]"
        return "click[Buy Now]"

    def expert_steps(self) -> int | None:
        """Length of the expert's path from the search page (None with the real WebShop or an unfound goal)."""
        if self.real or self.goal is None:
            return None
        results = self.shop.search(expert_keywords(self.goal["instruction_text"]))
        if self.goal["asin"] not in results:
            return None
        return 3 + results.index(self.goal["asin"]) // PAGE_SIZE + len(self.goal["goal_options"])

    def think(self, action: str) -> str:
        parsed = parse_action(action)
        if parsed is None:
            return super().think(action)
        kind, arg = parsed
        fixed = {"buy now": "Everything matches; I will buy it.",
                 "next >": "The product I want is not on this page, so I check the next one.",
                 "< prev": "I should go back to the previous page.",
                 "back to search": "These results do not have what I need; I will search again."}
        if kind == "search":
            return f"I should search for {arg}."
        if arg.lower() in fixed:
            return fixed[arg.lower()]
        if arg.title() in SUBPAGES:
            return f"Let me read the {arg.lower()} to check the details."
        if ASIN.fullmatch(arg):
            return f"{arg} looks like what I need."
        return f"I need the '{arg}' option."
